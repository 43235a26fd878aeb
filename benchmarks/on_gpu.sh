#!/usr/bin/env bash
# Everything a lent GPU is for, in one run that fits a short lease (about 8 minutes), each stage
# under its own time limit so that one failing stage leaves the others' results:
#   1. the GPU kernel tests compiled for real (tests/test_gpu_kernels.py, the GPU flash tests);
#   2. the engine on the embedded model: greedy tokens, pallas_gpu against xla;
#   3. benchmarks/kernels.py: our kernels against XLA and JAX's shipped GPU kernels;
#   4. a random 1.1B bf16 Llama: transformers generate, then the engine with both backends, then
#      with int8 weights. `python -m benchmarks.gpu_engine report --out $OUT` renders the tables.
# Results go to $OUT (default ./gpu_out): one log and each stage's files. The machine has its own
# jax; wheels it lacks (llguidance, and flax if older than ours) come from .whl/, filled here with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64
# -d .whl llguidance flax` at the versions installed here.
#   bash benchmarks/on_gpu.sh
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
PY=${PY:-python3}
# 60% of the GPU's memory for each JAX process: torch writes the 1.1B model beside the tests.
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 \
  JAX_TRACEBACK_FILTERING=off

if ls .whl/llguidance-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/llguidance-*.whl
  $PY -c 'import flax, sys; sys.exit(tuple(map(int, flax.__version__.split(".")[:2])) < (0, 12))' ||
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flax-*.whl
fi
export PYTHONPATH=/tmp/site:$PWD

stage() {   # stage NAME SECONDS COMMAND...: run with a limit, log its output and its exit status
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  echo "=== $name" >>"$LOG"
  timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  echo "=== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$LOG"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c 'import jax, flax, transformers, torch; print(jax.__version__, jax.devices(), flax.__version__,
transformers.__version__, torch.__version__)'; } >>"$LOG" 2>&1

# The 1.1B model is written by torch while the tests run.
$PY -m benchmarks.gpu_engine build --out "$OUT" >"$OUT/build.txt" 2>&1 &
BUILD=$!
# Mosaic GPU's layout inference, which refused a kernel once: its source beside the log.
$PY -c 'import jax.experimental.mosaic.gpu.layout_inference as m; print(m.__file__)' | xargs -I{} cp {} "$OUT"
stage "kernel tests, compiled" 80 $PY -m pytest -q -p no:cacheprovider --maxfail 3 tests/test_gpu_kernels.py \
  tests/test_flash_attention.py -k "gpu"
stage "engine, tiny model" 75 $PY -m benchmarks.gpu_engine jax --model tiny --out "$OUT"
stage "kernel benchmark" 110 $PY benchmarks/kernels.py --out "$OUT"
wait $BUILD
cat "$OUT/build.txt" >>"$LOG" && rm "$OUT/build.txt"
stage "transformers, 1.1B" 75 $PY -m benchmarks.gpu_engine hf --model 1b --out "$OUT"
stage "engine, 1.1B" 150 $PY -m benchmarks.gpu_engine jax --model 1b --out "$OUT"
stage "engine, 1.1B int8" 75 $PY -m benchmarks.gpu_engine jax --model 1b --backends pallas_gpu \
  --quantization int8 --out "$OUT"
grep -E "passed|failed|^\[" "$LOG" | tail -8
echo "all stages: $SECONDS s"
