import gc
import os

# Keep each xdist worker to its share of the 2 cores and never pick up an accelerator. Compiling
# is most of the suite's time and the tests' programs are small: LLVM at -O0 (an engine's warm-up
# takes 28% less), and XLA:CPU's older loop emitters rather than its MLIR fusion emitters, which
# owned half of what remained (the test engine's 30 compilations: 21 -> 11 s, 2026-11-27). The
# compile-only TPU and GPU checks pass alike. Not on a GPU (benchmarks/on_gpu.sh): -O0 would
# reach its code too, and the kernel tests there are meant as they run in serving.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
    # One OpenMP/BLAS thread for torch and numpy here and in the servers: beside the other worker,
    # two spinning OpenMP threads made a transformers forward of the embedded model 15x slower
    # (200 vs 13 ms, 2026-11-27); its logits are bit for bit the same on one thread.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0 "
                                       "--xla_cpu_use_fusion_emitters=false")

import jax  # noqa: E402  after the flags: they are read as JAX starts its CPU client
import pytest  # noqa: E402


def fake_devices_env(n: int) -> dict[str, str]:
    """The environment of a subprocess on n fake CPU devices, with this process's XLA flags."""
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={n} " + os.environ.get("XLA_FLAGS", "")}

# The heaviest files first, the longest first (one worker's minutes on the 2-core box, from the
# suite's --durations: the quantized engine ~3 (2026-11-29, under load; alone 2.9), spec-decode
# draft ~13 before its trim, family engine and multi-step ~4, shutdown, spec decode, kv isolation,
# TPU compile and parallel 2.5-3.5, soak and flash attention 2, the next three ~1, scoring and
# weight update ~0.7): `-n 2 --dist loadfile` hands out whole files in collection order (the rest
# alphabetical: the long ones among them, GPU compile, LoRA, models, MoE and paged attention at
# 1-2.5, come before the middle; the last ones are short), and a long one handed out last runs
# alone at the end while the other worker idles.
HEAVY_FIRST = ["test_quantized_engine.py", "test_spec_decode_draft.py", "test_family_engine.py", "test_multi_step.py",
               "test_shutdown.py", "test_spec_decode.py", "test_kv_isolation.py", "test_tpu_compile.py",
               "test_parallel.py", "test_soak.py", "test_flash_attention.py", "test_engine.py",
               "test_structured_output.py", "test_scoring.py", "test_weight_update.py"]


def pytest_configure(config):
    # xdist sorts the files by their number of tests (most first) unless told not to, which put
    # the heavy files, with few tests each, last: keep the order below.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return HEAVY_FIRST.index(name) if name in HEAVY_FIRST else len(HEAVY_FIRST)
    items.sort(key=rank)   # stable: the order within each file and among the rest is kept


@pytest.fixture(scope="module", autouse=True)
def free_executables():
    """After each test file, drop JAX's caches of compiled programs. Each XLA:CPU executable holds
    ~110-150 memory maps of JIT code until then, and a worker that keeps a few hundred of them
    reaches vm.max_map_count (65,530): the next compilation or load segfaults (CI, 2026-11-26 and
    -27; the worker's file then hung xdist). Engines still alive keep their own executables."""
    yield
    jax.clear_caches()
    gc.collect()
