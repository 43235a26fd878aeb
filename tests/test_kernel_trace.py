"""benchmarks/kernel_trace.py's sums of a Mosaic GPU profiler trace, on a trace written by hand."""
from benchmarks.kernel_trace import UNNAMED, region_cycles, summary_rows


def events(tid, *marks):
    """marks: (phase, name, cycles); the profiler's ts is in thousands of cycles."""
    return [dict(ph=ph, name=name, ts=cycles / 1e3, tid=tid, pid=1) for ph, name, cycles in marks]


def test_regions_summed_per_name_over_warpgroups():
    trace = events(1, ("B", "k_wait", 0), ("E", "k_wait", 1000), ("B", "qk", 1000), ("E", "qk", 1500),
                   # 500 cycles in no region, then a region with one nested in it
                   ("B", "k_wait", 2000), ("B", "inner", 2050), ("E", "inner", 2100), ("E", "k_wait", 2200))
    trace += events(2, ("B", "qk", 10_000), ("E", "qk", 10_100))
    regions, total, warpgroups = region_cycles(trace)
    assert warpgroups == 2 and total == 2200 + 100
    assert {n: (e, round(c)) for n, (e, c) in regions.items()} == {
        "k_wait": (2, 1200), "qk": (2, 600), UNNAMED: (0, 500)}   # "inner" counted inside k_wait
    rows = summary_rows(regions, total, warpgroups)
    assert rows[0] == ["k_wait", "1.0", "600", f"{100 * 1200 / 2300:.1f}%"]
    assert [r[0] for r in rows] == ["k_wait", "qk", UNNAMED]
