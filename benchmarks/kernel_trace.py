"""Where our GPU kernels spend their time inside a call: Mosaic GPU's profiler records when each
warpgroup enters and leaves the kernels' named regions (k_wait, qk, mask, softmax, v_wait, pv,
...: jax.named_scope in pallas_kernels/*/gpu.py; `trace_dir` in wgmma.compiler_params), and
this sums them per region over every warpgroup of one call.

  python benchmarks/kernel_trace.py --out DIR     (a Hopper GPU)

Shapes: issue 14's targets, paged decode of 64 sequences over 2k contexts (page 16; under each
lowering) and causal flash prefill of 4k tokens (also without the producer warpgroup, and with
early K waits) and of 1k, heads (32, 8, 128) in bf16. Writes DIR/kernel_trace_<device>.md. Times are SM
clock cycles (the profiler's dump takes its own cost, a few cycles an event, out); a region's
share is of the warpgroups' time from their first event to their last, and what no region covers
is shown as its own row.
"""
import argparse
import collections
import functools
import glob
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a script: find benchmarks/
from benchmarks.common import markdown_table, write_keeping_notes  # noqa: E402
from benchmarks.kernels import device_info, paged_case  # noqa: E402
from pallas_kernels.flash_attention import gpu as flash_gpu  # noqa: E402
from pallas_kernels.paged_attention import gpu as paged_gpu  # noqa: E402

HEADS = (32, 8, 128)
UNNAMED = "(no region)"


def region_cycles(events):
    """Chrome trace events ("B"/"E" pairs, each warpgroup a tid, ts in thousands of cycles) ->
    (name -> [entries, cycles], cycles from each warpgroup's first event to its last, summed,
    warpgroups)."""
    regions = collections.defaultdict(lambda: [0, 0.0])
    open_at, spans = {}, {}
    for e in events:
        tid, ts = e["tid"], e["ts"] * 1e3
        stack = open_at.setdefault(tid, [])
        if e["ph"] == "B":
            stack.append(ts)
        else:
            entered = stack.pop()
            if not stack:  # nested regions count in their outermost one's time only once
                regions[e["name"]][0] += 1
                regions[e["name"]][1] += ts - entered
        first, last = spans.get(tid, (ts, ts))
        spans[tid] = (min(first, ts), max(last, ts))
    total = sum(last - first for first, last in spans.values())
    regions[UNNAMED] = [0, total - sum(cycles for _, cycles in regions.values())]
    return dict(regions), total, len(spans)


def summary_rows(regions, total, warpgroups):
    """Table rows, largest region first: name, entries per warpgroup, cycles per entry, share."""
    rows = []
    for name, (entries, cycles) in sorted(regions.items(), key=lambda kv: -kv[1][1]):
        per_entry = f"{cycles / entries:,.0f}" if entries else ""
        rows.append([name, f"{entries / warpgroups:.1f}" if entries else "", per_entry,
                     f"{100 * cycles / total:.1f}%"])
    return rows


def traced_call(fn, args, trace_dir):
    """The events of fn's last call: its first call compiles it; each call writes a trace."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
        jax.effects_barrier()  # the trace is written by a host callback
    newest = max(glob.glob(os.path.join(trace_dir, "*-trace.json")), key=os.path.getmtime)
    with open(newest) as f:
        return json.load(f)["traceEvents"]


def kernels():
    """label -> (kernel taking trace_dir, its inputs)."""
    case = paged_case([1] * 64, [2048] * 64, 16, HEADS, jnp.bfloat16)
    paged_args = tuple(case[n] for n in ("q", "k_pages", "v_pages", "page_table", "seq_lens", "query_start_loc"))
    out = {}
    for lowering in ("warpgroup", "lane"):
        out[f"paged decode, B=64 ctx=2048 page=16, {lowering} lowering"] = (functools.partial(
            paged_gpu.ragged_paged_attention, max_q=1, sm_scale=case["sm_scale"], lowering=lowering), paged_args)
    num_heads, num_kv_heads, head_dim = HEADS
    keys = jax.random.split(jax.random.key(0), 3)
    qkv = tuple(jax.random.normal(key, (1, 4096, h, head_dim), jnp.bfloat16)
                for key, h in zip(keys, (num_heads, num_kv_heads, num_kv_heads)))
    for label, blocks in (("", {}), (", no producer", dict(producer=False)),
                          (", early K wait", dict(early_k_wait=True))):
        out[f"flash prefill, causal, T=4096{label}"] = (functools.partial(
            flash_gpu.flash_attention, causal=True, **blocks), qkv)
    # 1k: ~4.5 steps a warpgroup, so what a CTA pays once (Q, the first K, the output) shows
    out["flash prefill, causal, T=1024"] = (functools.partial(flash_gpu.flash_attention, causal=True),
                                            tuple(x[:, :1024] for x in qkv))
    return out


def section(label, kernel, args):
    # A folder per kernel: a call's trace is the newest file in its own folder.
    with tempfile.TemporaryDirectory() as trace_dir:
        try:
            regions, total, warpgroups = region_cycles(
                traced_call(jax.jit(functools.partial(kernel, trace_dir=trace_dir)), args, trace_dir))
        except Exception as e:  # noqa: BLE001 - one kernel's failure is its section's result
            return [f"## {label}", "", f"error: {type(e).__name__}: {str(e)[:300]}", ""]
    return [f"## {label}", "", f"{warpgroups} warpgroups, {total / warpgroups:,.0f} cycles each on average.", "",
            *markdown_table(["region", "entries per warpgroup", "cycles per entry", "share"],
                            summary_rows(regions, total, warpgroups), right_aligned=(1, 2, 3)), ""]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    slug, kind, _, _ = device_info()
    lines = [f"# Inside our GPU kernels on {kind}", "",
             f"jax {jax.__version__}; `python benchmarks/kernel_trace.py` (module docstring: what is measured).", ""]
    for label, (kernel, kernel_args) in kernels().items():
        lines += section(label, kernel, kernel_args)
    write_keeping_notes(os.path.join(args.out, f"kernel_trace_{slug}.md"), "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
