import os
import shutil
import tempfile

import pytest

# Keep each xdist worker to its share of the 2 cores and never pick up an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
# XLA's backend optimizations off (LLVM at -O0, no expensive passes) in the tests and in the servers
# and other subprocesses they start: on CPU compilation is most of the suite's time, and the tests
# check what programs compute, not how fast. The HLO passes, which the copy and collective counts
# read, run as before; the files below compile for real TPUs and GPUs, as production does.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
UNOPTIMIZED = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"
ACCELERATOR_COMPILE_FILES = {"test_tpu_compile.py", "test_tpu_paged_compile.py", "test_gpu_compile.py",
                             "test_quantization.py", "test_quantized_engine.py"}

# The heaviest files first, the longest first (one worker's minutes on the 2-core box, from the
# suite's --durations: spec-decode draft ~13 before its trim, family engine ~4, quantized engine,
# shutdown, spec decode, kv isolation, TPU compile and parallel 2.5-3.5, soak 2, the last three ~1):
# `-n 2 --dist loadfile` hands out whole files in collection order (the rest alphabetical, each
# under a minute), and a long one handed out last runs alone at the end while the other worker idles.
HEAVY_FIRST = ["test_spec_decode_draft.py", "test_family_engine.py", "test_quantized_engine.py", "test_shutdown.py",
               "test_spec_decode.py", "test_kv_isolation.py", "test_tpu_compile.py", "test_parallel.py", "test_soak.py",
               "test_engine.py", "test_structured_output.py", "test_engine_kernels.py"]


# JAX's persistent compilation cache, shared by the xdist workers of one run (not by the servers
# and other subprocesses the tests start, nor kept between runs): a program that both workers, or
# two tests a `jax.clear_caches()` apart, compile is compiled once. The controller makes the
# directory before it starts the workers (they inherit the variable) and removes it at the end.
JAX_CACHE_ENV = "JAXSERVE_TEST_JAX_CACHE"


def _use_jax_cache(directory: str) -> None:
    import jax

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

    # A program served from the cache is one this process needed: it counts as a compilation
    # (CompileCounter counts XLA's backend compilations only), so the tests' "nothing compiled after
    # warm-up" checks still fail when a program missing from warm-up comes from the cache.
    def count_hit(event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            jax.monitoring.record_event_duration_secs("/jax/core/compile/backend_compile_duration", 0.0)
    jax.monitoring.register_event_listener(count_hit)


def pytest_configure(config):
    import jax

    jax.config.update("jax_disable_most_optimizations", UNOPTIMIZED)   # whatever imported jax first
    if JAX_CACHE_ENV not in os.environ:   # the controller, or a run without xdist
        os.environ[JAX_CACHE_ENV] = tempfile.mkdtemp(prefix="jaxserve-test-jax-cache-")
        config.jax_cache_owner = True
    _use_jax_cache(os.environ[JAX_CACHE_ENV])
    # xdist sorts the files by their number of tests (most first) unless told not to, which put
    # the heavy files, with few tests each, last: keep the order below.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.fixture(scope="module", autouse=True)
def accelerator_compiles_optimized(request):
    """Before the module's own fixtures (autouse comes first in its scope)."""
    import jax

    if request.path.name not in ACCELERATOR_COMPILE_FILES:
        yield
        return
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", UNOPTIMIZED)


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return HEAVY_FIRST.index(name) if name in HEAVY_FIRST else len(HEAVY_FIRST)
    items.sort(key=rank)   # stable: the order within each file and among the rest is kept


def pytest_unconfigure(config):
    if getattr(config, "jax_cache_owner", False):
        shutil.rmtree(os.environ.pop(JAX_CACHE_ENV), ignore_errors=True)
