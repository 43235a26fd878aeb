"""The collectives of a compiled HLO module, read from its text: to check that a sharding layout
costs what it should (benchmarks/parallel.py, tests/test_parallel.py)."""
from __future__ import annotations

import math
import re

_COLLECTIVE = re.compile(
    r"=\s*(?P<shape>\([^)]*\)|\S+)\s+(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute|collective-broadcast)(?:-start)?\((?P<rest>.*)$")
_ARRAY = re.compile(r"(pred|[a-z]+)(\d+)?\[([\d,]*)\]")


def _group_size(op: str, rest: str) -> int:
    if op == "collective-permute":
        return 2  # point to point
    # mesh form, device_ids present when the devices are not in mesh order
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\S+)?\s*\{([^}]*)\}", rest):
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'([^']+)'", m.group(2)))
    if m := re.search(r"replica_groups=\[[\d,]*?(\d+)\]<=", rest):               # iota form
        return int(m.group(1))
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", rest):                   # explicit
        return len(m.group(1).split(","))
    return 0  # unknown form


def hlo_collectives(hlo_text: str) -> list[dict]:
    """The collectives of a compiled HLO module (async -start/-done pairs counted once):
    [{"op", "bytes" (of the result), "group" (devices taking part)}]."""
    out = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if m is None:
            continue
        nbytes = 0
        for kind, bits, dims in _ARRAY.findall(m.group("shape")):
            width = 1 if kind == "pred" else int(bits or 32) // 8
            nbytes += width * math.prod(int(d) for d in dims.split(",") if d)
        op = m.group("op")
        out.append({"op": op, "bytes": nbytes, "group": _group_size(op, m.group("rest"))})
    return out
