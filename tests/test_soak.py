"""A 30-second soak of the real server (benchmarks/soak.py): mixed load with injected engine
faults, preemption, clients that leave, deadlines and malformed requests; nothing lost, pages
back, memory flat, TTFT steady, a clean exit.

The TTFT check compares two latency tails, which on an oversubscribed machine (load average
above its core count: other jobs take the CPU in bursts) measure the neighbours more than the
server. There its failure is reported as a warning; on a machine that is not oversubscribed it
fails the test like every other check.
"""
import argparse
import os
import tempfile
import warnings

from benchmarks import soak

DURATION_S = 30
# ~2,700 steps in 40 s on an idle 2-core box, under 1,000 beside the rest of the suite
# (2026-11-27, when a fault every 1,000 steps injected none): at least one fault in 30 s needs 10 steps/s.
FAULT_EVERY = 300


def test_soak_loses_nothing(tmp_path):
    args = argparse.Namespace(duration=DURATION_S, clients=4, fault_every=FAULT_EVERY, seed=1, decode_steps=1,
                              step_shapes="largest",   # 2 step programs to build before the load, not all
                              compilation_cache_dir=os.path.join(tempfile.gettempdir(), "jaxserve-test-xla-cache"),
                              out=str(tmp_path / "soak"))
    report = soak.run(args)
    soak.plot(report, args.out + ".png")
    oversubscribed = max(report["load_avg"]) > os.cpu_count()
    failed = [c for c in report["checks"] if not c["ok"]]
    noisy = [c for c in failed if oversubscribed and c["check"] == soak.TTFT_CHECK]
    if noisy:
        warnings.warn(f"{noisy[0]['check']}: {noisy[0]['value']} with load average {report['load_avg']} "
                      f"on {os.cpu_count()} cores")
    assert not [c for c in failed if c not in noisy], soak.markdown(report)
    kinds = {r["kind"] for r in report["requests"]}
    assert kinds == set(soak.KINDS), kinds   # every kind of request was sent
    assert os.path.getsize(args.out + ".png") > 0
