"""A 60-second soak of the real server (benchmarks/soak.py): mixed load with injected engine
faults, preemption, clients that leave, deadlines and malformed requests; nothing lost, pages
back, memory flat, TTFT steady, a clean exit."""
import argparse
import os
import tempfile

from benchmarks import soak

DURATION_S = 60


def test_soak_loses_nothing(tmp_path):
    args = argparse.Namespace(duration=DURATION_S, clients=4, fault_every=1000, seed=1,
                              compilation_cache_dir=os.path.join(tempfile.gettempdir(), "jaxserve-test-xla-cache"),
                              out=str(tmp_path / "soak"))
    report = soak.run(args)
    soak.write_report(args.out, report, soak.markdown, soak.plot)
    failed = [c for c in report["checks"] if not c["ok"]]
    assert not failed, soak.markdown(report)
    kinds = {r["kind"] for r in report["requests"]}
    assert kinds == set(soak.KINDS), kinds   # every kind of request was sent
    assert os.path.getsize(args.out + ".png") > 0
