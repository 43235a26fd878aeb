"""vLLM's sleep mode: an idle engine gives its accelerator memory back, so that an RL trainer
colocated with it (verl, OpenRLHF) can train between rollouts, then takes it again.

`sleep(engine, level)` puts away what is awake of vLLM's two tags:
  * "weights": level 1 copies them to host memory (numpy arrays, on every platform: on a CPU a
    device buffer is host memory already, so the copy is one of its own and the device buffer
    is freed all the same); level 2 keeps nothing, as the trainer is about to load its own.
    The model's params go, a draft model's and the LoRA slots' too; those two are always kept on
    the host, even at level 2 (the trainer's `load_weights` loads the served model's only).
  * "kv_cache": the page pools (a draft model's too) are dropped, their contents with them, and
    the prefix cache is forgotten (BlockManager.reset_prefix_cache): its pages are gone.
Either way the device buffers are deleted, not merely unreferenced.

`wake_up(engine, tags)` re-creates them with the shapes, dtypes and shardings they had, so every
compiled step (and warm-up's stored executables) takes them as before: nothing compiles. Weights
come back from the host copy, or after level 2 as zeros (placed from the host: a transfer, no
program to compile), which the caller must replace with the full set (`load_weights`) before
generating: the engine cannot tell zeros from weights. The KV pools come back zeroed by the
programs that zeroed them at start (kv_cache.KVCache.zeros). Waking "weights" alone lets a
trainer load weights before the KV pools take their memory (vLLM's tags).

While any tag sleeps, new requests are refused (EngineAsleep: HTTP 503) and weights cannot be
loaded into sleeping weights. Sleeping is refused while requests are in flight (the server waits
for them: EngineThread.call_when_idle), and across processes (as weight updates are).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxserve.kv_cache import KVCache

log = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")   # vLLM's; wake_up(tags=None) wakes both


class EngineAsleep(RuntimeError):
    """The engine sleeps (HTTP 503 for a request): wake_up first."""


class Stored(NamedTuple):
    """One put-away tree of device arrays: whose attribute it was, and how to place it again."""
    owner: Any
    name: str
    treedef: Any
    placements: list[jax.ShapeDtypeStruct]   # each leaf's shape, dtype and sharding
    host: list[np.ndarray] | None            # its values; None: dropped (wakes as zeros)


def require_awake(engine, tag: str | None = None) -> None:
    """EngineAsleep when `tag` (None: any tag) of `engine` sleeps."""
    asleep = [t for t in TAGS if t in engine.sleeping and tag in (None, t)]
    if asleep:
        raise EngineAsleep(f"the engine is sleeping ({' and '.join(asleep)} put away): wake it up first "
                           f"(LLM.wake_up, POST /wake_up{'?tags=' + tag if tag else ''})")


def sleep(engine, level: int = 1) -> None:
    """Put away every tag of an idle `engine` that is awake (nothing when all sleep, as vLLM's)."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 (weights to host memory) or 2 (weights dropped), got {level!r}")
    if jax.process_count() > 1:
        raise ValueError("sleep mode is for one process; a multi-host engine cannot sleep")
    if engine.has_unfinished():
        raise RuntimeError(f"{engine.num_requests} request(s) in flight: sleep between batches")
    t0 = time.perf_counter()
    for runner in _runners(engine):
        runner.wait_warm()   # background warm-up runs steps on the weights
        jax.block_until_ready((runner.params, runner.kv_cache))   # a step launched last may still run
    put_away = {}
    for tag in (t for t in TAGS if t not in engine.sleeping):
        # level 2 drops the served model's weights only: nothing else is the trainer's to load
        engine.sleeping[tag] = [_put_away(owner, name, tag == "weights" and (level == 1 or owner is not engine.runner))
                                for owner, name in _holders(engine, tag)]
        put_away[tag] = sum(math.prod(p.shape) * p.dtype.itemsize for s in engine.sleeping[tag] for p in s.placements)
    if "kv_cache" in put_away:
        assert engine.block_manager.reset_prefix_cache()   # no page is in use: nothing runs
    log.info("sleep level %d: put away %s in %.2fs; %s of device arrays left", level,
             ", ".join(f"{tag} {n / 2**30:.2f} GiB" for tag, n in put_away.items()) or "nothing",
             time.perf_counter() - t0, _gib(sum(live_device_bytes().values())))


def wake_up(engine, tags: list[str] | None = None) -> None:
    """Re-create the buffers of `tags` (None: all) that sleep; waking one that is awake does nothing."""
    tags = [t for t in checked_tags(tags) if t in engine.sleeping]
    t0 = time.perf_counter()
    for tag in tags:
        for stored in engine.sleeping[tag]:
            if tag == "kv_cache":   # zeroed as at start, by the same (cached) programs
                r = stored.owner
                r.kv_cache = KVCache.zeros(r.cfg, r.mesh, r.num_pages, r.page_size, r.dtype, r.ecfg.kv_cache_dtype,
                                          r.kv_groups)
            else:
                _restore(stored)
            jax.block_until_ready(getattr(stored.owner, stored.name))   # the memory is taken when this returns
        del engine.sleeping[tag]
    log.info("woke up %s in %.2fs; %s of device arrays", " and ".join(tags) or "nothing", time.perf_counter() - t0,
             _gib(sum(live_device_bytes().values())))


def checked_tags(tags: list[str] | None) -> list[str]:
    """wake_up's tags (None: all of them); ValueError for one that is not vLLM's."""
    tags = list(TAGS) if tags is None else list(tags)
    if unknown := [t for t in tags if t not in TAGS]:
        raise ValueError(f"unknown sleep mode tag(s) {unknown}: the tags are {list(TAGS)}")
    return tags


def live_device_bytes() -> dict[str, int]:
    """Bytes held by every live JAX array in this process, by device (each device's shard)."""
    out: dict[str, int] = {}
    for x in jax.live_arrays():
        shard = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for d in x.sharding.addressable_devices:
            out[str(d)] = out.get(str(d), 0) + shard
    return out


def _runners(engine) -> list:
    return [engine.runner] + ([engine.draft.runner] if engine.draft is not None else [])


def _holders(engine, tag: str) -> list[tuple[Any, str]]:
    """(object, attribute) of each tree of device arrays under `tag`."""
    if tag == "kv_cache":
        return [(r, "kv_cache") for r in _runners(engine)]
    return [(r, "params") for r in _runners(engine)] + ([(engine.loras, "weights")] if engine.loras is not None else [])


def _put_away(owner, name: str, keep: bool) -> Stored:
    """owner.<name>'s device buffers deleted (copied to the host first if `keep`); the attribute set
    to None, so a stray use fails at once, not in XLA."""
    leaves, treedef = jax.tree.flatten(getattr(owner, name))
    placements = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
    host = None
    if keep:
        for x in leaves:   # every transfer under way before the first is waited for (accelerators)
            x.copy_to_host_async()
        host = [_host_copy(x) for x in leaves]
    for x in leaves:
        x.delete()
    setattr(owner, name, None)
    return Stored(owner, name, treedef, placements, host)


def _host_copy(x: jax.Array) -> np.ndarray:
    """x's values in host memory of their own. From an accelerator np.asarray is the transfer's
    buffer; on a CPU it may be a view of the device buffer itself, about to be deleted: a copy."""
    on_cpu = all(d.platform == "cpu" for d in x.sharding.device_set)
    return np.array(x) if on_cpu else np.asarray(x)


def _restore(stored: Stored) -> None:
    values = stored.host if stored.host is not None else [np.zeros(p.shape, p.dtype) for p in stored.placements]
    leaves = jax.device_put(values, [p.sharding for p in stored.placements])
    setattr(stored.owner, stored.name, jax.tree.unflatten(stored.treedef, leaves))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
