"""Counts this process's XLA compilations. Warm-up compiles every step shape, so while serving
the count stays flat: /metrics shows it (jaxserve_xla_compilations_total), the runner logs what
warm-up took, and tests and the offline benchmark assert that serving compiles nothing."""
from __future__ import annotations

import jax


class CompileCounter:
    count = 0
    _registered = False

    @classmethod
    def install(cls):
        if not cls._registered:
            def listener(event, *args, **kwargs):
                if event == "/jax/core/compile/backend_compile_duration":
                    cls.count += 1
            jax.monitoring.register_event_duration_secs_listener(listener)
            cls._registered = True
