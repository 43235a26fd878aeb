"""What a compiled TPU step costs, read from its HLO text (`compiled.as_text()`).

`compiled.cost_analysis()` is no step-time proxy for the looped steps here (its optimal_seconds
came out negative, and "bytes accessed" counts the whole aliased pool). What does work:
  * whole-pool copies: ops outside fusions that produce a buffer the size of one layer's K or
    V pool (or up to a quarter more: padded), other than the in-place KV update (a scatter or
    dynamic-update-slice, bare or fused) and broadcasts (made from a smaller array: XLA:TPU
    broadcasts int4's and fp8's grouped weight scales to the weight's shape in VMEM, which
    matched the pool's size for Qwen3-8B's MLP weights on v5e). Layouts the tiles refuse and
    flat views of the pool show up as such copies, each a pass over the pool's HBM per step (or
    per loop iteration). An async start's result tuple
    also names its operand: only its new buffer counts. (Seen on Llama-3-70B at v6e-8:
    memory-space assignment moves one layer's pool into another memory space in 4 MiB
    slices, joins them, updates it there and copies it back: two passes, not 23 slices);
  * the heaviest loop body: the sum of the TPU compiler's per-op `estimated_cycles` over one
    while loop's body, the most expensive such body of the step;
  * conditionals: XLA:GPU hands each one's predicate to the host and waits for it, which holds
    the launching thread until the device gets there (a TPU decides on the chip);
  * sliced kernel operands: Mosaic GPU kernels' operands that are slices not starting at 0. XLA:GPU
    passes such a slice as a view into the sliced buffer, and Mosaic GPU refuses at run time one
    that is not 256-byte aligned ("Input buffer 1 is not 256-byte aligned", H200, 2026-11-27).
"""
from __future__ import annotations

import math
import re
from typing import NamedTuple

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
# element type, its bits, dims: s8[..], bf16[..], pred[..], f8e4m3fn[..] (8 bits, the rest its format)
_ARRAY = re.compile(r"\b(pred|[a-z]+)(\d*)(?:e\d+m\d+\w*)?\[([\d,]*)\]")
_OPCODE = re.compile(r"^([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_BODY = re.compile(r"body=%?([\w.\-]+)")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_OPERANDS = re.compile(r"custom-call\(([^)]*)\)")
_SLICE_STARTS = re.compile(r"slice=\{([^}]*)\}")

# Ops that name or pass on a buffer without writing one.
_NO_NEW_BUFFER = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
                  "call", "copy-done", "opt-barrier", "constant", "after-all", "add-dependency"}
_IN_PLACE_UPDATES = {"scatter", "dynamic-update-slice"}
_FROM_SMALLER = {"broadcast"}   # a new buffer, but no pass over one the size of the pool
# Async starts: (result tuple element that is the new buffer); the others alias the operand
# (copy-start: (destination, source, context); slice-start: ((operand), slice, context)).
_ASYNC_NEW_BUFFER = {"copy-start": 0, "slice-start": 1}


class Instruction(NamedTuple):
    name: str
    opcode: str
    result_bytes: tuple[int, ...]   # each array of the result (one, or a tuple's elements)
    line: str


class StepCost(NamedTuple):
    whole_pool_copies: int
    heaviest_loop_cycles: int       # 0 when the step has no loop
    copies: tuple[str, ...]         # the copying instructions, "opcode name"
    conditionals: int               # in the HLO text (one in a loop runs every iteration)
    sliced_kernel_operands: int     # Mosaic GPU kernel operands that are views at an offset


def _split_result(rest: str) -> tuple[str, str]:
    """'(a, b) op(...)' or 'a op(...)' -> (result type text, 'op(...)')."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return rest[:i + 1], rest[i + 1:].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def _tuple_elements(type_text: str) -> list[str]:
    """'(a, (b, c), d)' -> ['a', '(b, c)', 'd']."""
    out, depth, start = [], 0, 1
    for i, ch in enumerate(type_text):   # shapes and layouts hold commas too: [2,3]{1,0}
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if (ch == "," and depth == 1) or depth == 0:
            out.append(type_text[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return out


def _array_bytes(type_text: str) -> tuple[int, ...]:
    return tuple((1 if kind == "pred" else int(bits or 0) // 8) * math.prod(int(d) for d in dims.split(",") if d)
                 for kind, bits, dims in _ARRAY.findall(type_text))


def parse_hlo(text: str) -> dict[str, list[Instruction]]:
    """Computation name -> its instructions."""
    computations: dict[str, list[Instruction]] = {}
    current = None
    for line in text.splitlines():
        if m := _COMPUTATION.match(line):
            current = computations.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTRUCTION.match(line)):
            result, rest = _split_result(m.group(2))
            if op := _OPCODE.match(rest):
                if op.group(1) in _ASYNC_NEW_BUFFER:
                    result = _tuple_elements(result)[_ASYNC_NEW_BUFFER[op.group(1)]]
                current.append(Instruction(m.group(1), op.group(1), _array_bytes(result), line))
    return computations


def step_cost(hlo_text: str, pool_bytes: int) -> StepCost:
    """Whole-pool copies and the heaviest loop body of a compiled step; `pool_bytes`: one
    layer's K (or V) pool on one chip."""
    computations = parse_hlo(hlo_text)
    fused = {m.group(1) for ops in computations.values() for i in ops if i.opcode == "fusion"
             for m in [_CALLS.search(i.line)] if m}

    def updates_in_place(i: Instruction) -> bool:
        if i.opcode in _IN_PLACE_UPDATES:
            return True
        called = _CALLS.search(i.line) if i.opcode == "fusion" else None
        return called is not None and any(f.opcode in _IN_PLACE_UPDATES for f in computations.get(called.group(1), []))

    def pool_sized(i: Instruction) -> bool:
        # up to a quarter more: a relayout first pads the page dim to a multiple of its tile
        return any(pool_bytes <= b <= pool_bytes * 5 // 4 for b in i.result_bytes)

    copies = tuple(f"{i.opcode} {i.name}" for name, ops in computations.items() if name not in fused
                   for i in ops if pool_sized(i) and i.opcode not in _NO_NEW_BUFFER | _FROM_SMALLER
                   and not updates_in_place(i))
    bodies = {m.group(1) for ops in computations.values() for i in ops if i.opcode == "while"
              for m in [_BODY.search(i.line)] if m}
    cycles = [sum(int(c) for i in computations.get(body, []) for c in _CYCLES.findall(i.line)) for body in bodies]
    conditionals = sum(i.opcode == "conditional" for ops in computations.values() for i in ops)
    return StepCost(len(copies), max(cycles, default=0), copies, conditionals, _sliced_kernel_operands(computations))


def _sliced_kernel_operands(computations: dict[str, list[Instruction]]) -> int:
    """Operands of Mosaic GPU custom calls made by a slice (bare, or a fusion's root) whose start
    is not 0 in some dimension."""
    def offset_slice(i: Instruction) -> bool:
        if i.opcode == "fusion" and (called := _CALLS.search(i.line)):
            i = next((f for f in computations.get(called.group(1), []) if f.line.lstrip().startswith("ROOT ")), i)
        starts = _SLICE_STARTS.search(i.line) if i.opcode == "slice" else None
        return starts is not None and any(not s.startswith("[0:") for s in starts.group(1).split(", "))

    count = 0
    for ops in computations.values():
        defined = {i.name: i for i in ops}
        for i in ops:
            if i.opcode == "custom-call" and 'custom_call_target="mosaic_gpu' in i.line:
                operands = re.findall(r"%([\w.\-]+)", _OPERANDS.search(i.line).group(1))
                count += sum(offset_slice(defined[o]) for o in operands if o in defined)
    return count
