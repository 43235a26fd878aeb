#!/usr/bin/env bash
# Everything a lent GPU is for, each stage under its own time limit so that one failing stage
# leaves the others' results:
#   tests    the GPU kernel tests compiled for real (tests/test_gpu_kernels.py, the GPU flash tests;
#            TESTS=<pytest -k expression> narrows them)
#   tiny     the engine on the embedded model: greedy tokens, pallas_gpu against xla, with prompts
#            packed into steps (the flash kernel's segment ids)
#   copy     the same on a small Llama trained here to repeat its prompt (gpu_engine.build_copy):
#            its greedy tokens are decisive, so both backends must give the prompt back exactly
#   kernels  benchmarks/kernels.py: our kernels against XLA and JAX's shipped GPU kernels; with
#            BASE=<tree> (see ab), then the prefill table of that tree's kernels ($OUT/base)
#   lane     the paged kernel under its Lane lowering (pallas_kernels/wgmma.py): its tests, then the
#            decode and mixed tables with it beside the default (in $OUT/lane). Apart from the
#            stages before it, which a GPU fault in an unproven lowering would otherwise cut short
#   trace    inside our kernels: each warpgroup's cycles per region (k_wait, qk, softmax, ...) at the
#            decode and prefill target shapes (benchmarks/kernel_trace.py; Mosaic GPU's profiler)
#   hf       a random 1.1B bf16 Llama under transformers generate (static batches)
#   1b       the engine on it, both backends (BACKENDS=pallas_gpu: that one only)
#   int8     the engine on it with int8 weights
#   steps    the engine on it, pallas_gpu, with decode_steps 8 (multi-step decoding: the host plans
#            and collects once per 8 decode steps; the 1b stage's pallas_gpu row is its baseline)
#   profile  where the time goes: the kernels of our paged-attention calls (kernels.py --profile) and
#            of the 1.1B engine's decode and prefill steps (benchmarks/step_profile.py), and how much
#            of each the GPU was busy
#   cmdbuf   (only when named) the 1b stage on pallas_gpu twice on the same GPU, as is and with XLA's
#            conditionals and loops in CUDA graphs (command buffers): XLA:GPU otherwise reads each
#            conditional's predicate on the host, holding the launching thread (the sampler has 3;
#            the steps have none), so the host cannot queue step N + 1 while step N runs
#   ab       (only when named, with BASE=<tree>) the 1b stage on pallas_gpu for this tree and then
#            an earlier one, on the same warm GPU: e.g. `mkdir base && git archive d2d8cc4 | tar -x -C
#            base` here before the call (an untracked folder travels with the working tree; an
#            ignored one only when the device call carries it)
# tests, tiny and copy check tokens, not time: tests run beside tiny then copy. The timed stages
# (kernels, lane, trace, hf, 1b, steps, int8, profile) run alone. At their limits all stages take half an
# hour; one device call runs 10 minutes at most and a session has 15 minutes of device time, starts
# included, so give the stages that matter most in two calls, back to back while the machine is warm:
#   BASE=base BACKENDS=pallas_gpu bash benchmarks/on_gpu.sh kernels hf 1b
#   bash benchmarks/on_gpu.sh tests copy trace profile
# (2026-11-28, H200: the first took 297 s, `trace 1b` 250 s, before kernels.py gained its GPU ms.
# H100, session 31: the first 343 s, tiny at its limit; `tests kernels hf 1b` with TESTS narrowed,
# BASE and BACKENDS=pallas_gpu 413 s, hf at its old 80 s limit.)
# XLA's GEMM autotuning results go to one cache folder, shared by the stages: the engines of the
# 1.1B model tune the same matrix products once.
# `python -m benchmarks.gpu_engine report --out $OUT` renders the engine tables.
# Results go to $OUT (default ./gpu_out): one log and each stage's files. The machine has its own
# jax; wheels it lacks (llguidance, and flax if older than ours) come from .whl/, filled here with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_31_x86_64
# -d .whl llguidance flax` at the versions installed here.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
PY=${PY:-python3}
STAGES=" ${*:-tests copy kernels lane trace hf 1b steps int8 profile} "
# 30% of the GPU's memory for each JAX process: torch writes the 1.1B model beside the tests.
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 \
  JAX_TRACEBACK_FILTERING=off
AUTOTUNE="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/jaxserve_gpu/autotune"
XLA_FLAGS="${XLA_FLAGS:-} $AUTOTUNE" $PY -c 'import jax' 2>/dev/null && export XLA_FLAGS="${XLA_FLAGS:-} $AUTOTUNE"

if ls .whl/llguidance-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/llguidance-*.whl
  $PY -c 'import flax, sys; sys.exit(tuple(map(int, flax.__version__.split(".")[:2])) < (0, 12))' ||
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flax-*.whl
fi
export PYTHONPATH=/tmp/site:$PWD

stage() {   # stage NAME SECONDS COMMAND...: if NAME was asked for, run it with a limit and log it
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  [[ $STAGES == *" $name "* ]] || return 0
  # SIGINT at the limit: pytest then still prints the failures it has (SIGTERM would lose them).
  timeout -s INT -k 10 "$limit" "$@" >"$LOG.$name" 2>&1
  local rc=$?
  { echo "=== $name"; cat "$LOG.$name"; echo "=== $name: rc $rc in $((SECONDS - t0)) s"; } >>"$LOG"
  rm "$LOG.$name"
  echo "=== $name: rc $rc in $((SECONDS - t0)) s"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY -c 'import jax, flax, transformers, torch; print(jax.__version__, jax.devices(), flax.__version__,
transformers.__version__, torch.__version__)'; } >>"$LOG" 2>&1

# The 1.1B model is written by torch while the first stages run.
if [[ $STAGES =~ " "(hf|1b|steps|int8|profile|cmdbuf|ab)" " ]]; then
  $PY -m benchmarks.gpu_engine build --out "$OUT" >>"$LOG.build" 2>&1 &
fi
# The flash kernel's segment-id tests first: packed prompts (the tiny stage's steps) depend on them.
stage tests 240 $PY -m pytest -q -p no:cacheprovider --maxfail 20 tests/test_flash_attention.py \
  tests/test_gpu_kernels.py -k "${TESTS:-gpu and not lane}" &
stage tiny 200 $PY -m benchmarks.gpu_engine jax --model tiny --out "$OUT"
stage copy 240 bash -c "$PY -m benchmarks.gpu_engine build --model copy --out $OUT &&
  $PY -m benchmarks.gpu_engine jax --model copy --out $OUT"
wait
[[ -f "$LOG.build" ]] && cat "$LOG.build" >>"$LOG" && rm "$LOG.build"
stage kernels 260 bash -c "$PY benchmarks/kernels.py --sections decode,prefill,mixed,kv_write --out $OUT
  ${BASE:+mkdir -p $OUT/base && PYTHONPATH=/tmp/site:$BASE $PY $BASE/benchmarks/kernels.py --sections prefill --out $OUT/base}"
mkdir -p "$OUT/lane"
stage lane 200 bash -c "$PY -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py -k lane;
  $PY benchmarks/kernels.py --sections decode,mixed --lane --out $OUT/lane"
# The profiler writes its trace from a host callback, which needs the CPU platform too.
stage trace 150 env JAX_PLATFORMS=cuda,cpu $PY benchmarks/kernel_trace.py --out "$OUT"
stage hf 150 $PY -m benchmarks.gpu_engine hf --model 1b --out "$OUT"
stage 1b 240 $PY -m benchmarks.gpu_engine jax --model 1b ${BACKENDS:+--backends $BACKENDS} --out "$OUT"
stage steps 240 $PY -m benchmarks.gpu_engine jax --model 1b --backends pallas_gpu --decode-steps 8 --out "$OUT"
stage int8 150 $PY -m benchmarks.gpu_engine jax --model 1b --backends pallas_gpu --quantization int8 --out "$OUT"
CMDBUF="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
stage cmdbuf 360 bash -c "for flags in '' '$CMDBUF'; do out=$OUT/cmdbuf/\${flags:+on} && mkdir -p \${out%/} &&
  XLA_FLAGS=\"\${XLA_FLAGS:-} \$flags\" $PY -m benchmarks.gpu_engine jax --model 1b --backends pallas_gpu --out \${out%/}; done"
stage ab 300 bash -c "for tree in $PWD ${BASE:-}; do out=$OUT/ab/\$(basename \$tree) && mkdir -p \$out &&
  PYTHONPATH=/tmp/site:\$tree $PY -m benchmarks.gpu_engine jax --model 1b --backends pallas_gpu --out \$out; done"
MODEL_1B=/tmp/jaxserve_gpu/llama-1b
stage profile 240 bash -c "$PY benchmarks/kernels.py --sections decode,mixed --profile --out $OUT/profile &&
  $PY -m benchmarks.step_profile --model $MODEL_1B --dtype bfloat16 --rows 64 --context 400 &&
  $PY -m benchmarks.step_profile --model $MODEL_1B --dtype bfloat16 --prefill 2 --context 256"
grep -E "passed|failed|^\[" "$LOG" | tail -8
echo "stages:$STAGES in $SECONDS s"
