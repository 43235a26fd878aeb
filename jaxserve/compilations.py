"""Counts this process's XLA compilations, in all and per thread. Warm-up compiles every step
shape (the smaller ones perhaps on its background thread, jaxserve/warmup.py), so once it has
finished the count stays flat, and the serving thread never compiles: /metrics shows the count
(jaxserve_xla_compilations_total), the runner logs what warm-up took, and tests and the offline
benchmark assert that serving compiles nothing."""
from __future__ import annotations

import threading

import jax


class CompileCounter:
    count = 0
    by_thread: dict[str, int] = {}   # thread name -> compilations (the event fires in the compiling thread)
    _lock = threading.Lock()
    _registered = False

    @classmethod
    def install(cls):
        if not cls._registered:
            def listener(event, *args, **kwargs):
                if event == "/jax/core/compile/backend_compile_duration":
                    name = threading.current_thread().name
                    with cls._lock:
                        cls.count += 1
                        cls.by_thread[name] = cls.by_thread.get(name, 0) + 1
            jax.monitoring.register_event_duration_secs_listener(listener)
            cls._registered = True

    @classmethod
    def on_this_thread(cls) -> int:
        return cls.by_thread.get(threading.current_thread().name, 0)
