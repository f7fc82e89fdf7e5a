"""Reading a compiled program's HLO text: its matmul FLOPs with every loop's trip count applied, and its
collectives by kind.

XLA's `cost_analysis()` counts a while loop's body once whatever its trip count, so a scanned model (one
layer's body run `num_layers` times) or a memory op's scan over chunks is undercounted by the loop's
length. Here each computation's own `dot` / `convolution` FLOPs are multiplied by how often it runs: the
product of the trip counts of the loops around it (XLA's `known_trip_count`, or the constant bound of
the loop's condition; a loop with neither counts once and is reported).
"""

from __future__ import annotations

import collections
import math
import re

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all")

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_TYPED = re.compile(r"\b(?:pred|[su]\d+|bf16|f\d+\w*|c\d+)\[[\d,]*\](?:\{[^}]*\})?")
_SHAPE = re.compile(r"\b(?:pred|[su]\d+|bf16|f\d+|f8\w*|c\d+)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_CALLS = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_DIMS = {name: re.compile(name + r"=\{([\d,]*)\}") for name in ("lhs_contracting_dims", "lhs_batch_dims")}


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _shapes(text: str) -> list[list[int]]:
    return [_dims(m.group(1)) for m in _SHAPE.finditer(text)]


def computations(hlo_text: str) -> dict[str, list[str]]:
    """`{computation name: its instruction lines}`, the entry computation under the key "ENTRY"."""
    out, name, body = {}, None, []
    for line in hlo_text.splitlines():
        if name is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                name, body = ("ENTRY" if line.startswith("ENTRY") else m.group(1)), []
        elif line.strip() == "}":
            out[name], name = body, None
        else:
            body.append(line)
    return out


def _parse(line: str):
    """`(name, result shape dims, op, operand names, the rest)` of an instruction line, or None."""
    m = _INSTR.match(line)
    if not m:
        return None
    args, _, rest = m.group(4).partition(")")
    shapes = _shapes(m.group(2))
    names = [a.strip().lstrip("%") for a in _TYPED.sub("", args).split(",") if a.strip()]  # `[shape] [%]name`
    return m.group(1), (shapes[0] if shapes else []), m.group(3), names, rest


def _instruction_flops(parsed, shapes: dict) -> float:
    """FLOPs of one `dot` or `convolution` (2 per multiply-add), else 0."""
    _, out, op, operands, rest = parsed
    if op not in ("dot", "convolution") or len(operands) < 2:
        return 0.0
    lhs, rhs = shapes.get(operands[0]), shapes.get(operands[1])
    if lhs is None or rhs is None:
        return 0.0
    if op == "dot":
        contracting = _DIMS["lhs_contracting_dims"].search(rest)
        k = math.prod(lhs[d] for d in _dims(contracting.group(1))) if contracting else 1
        return 2.0 * math.prod(out) * k
    labels = re.search(r"dim_labels=\w+_(\w+)->", rest)  # the kernel's labels: 'o' is its output features
    if not labels or len(labels.group(1)) != len(rhs):
        return 0.0
    return 2.0 * math.prod(out) * math.prod(rhs) / max(rhs[labels.group(1).index("o")], 1)


def _trip_count(rest: str, comps: dict) -> int | None:
    """A while loop's trip count: XLA's `known_trip_count`, else read from its condition `i < N` with N
    a constant (jax's loops count from 0 by 1); None when neither is there."""
    known = _TRIP.search(rest)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", rest)
    lines = comps.get(cond.group(1), []) if cond else []
    constants = {}
    for line in lines:
        m = re.match(r"^\s*%?([\w.\-]+)\s*=\s*s32\[\]\S*\s+constant\((-?\d+)\)", line)
        if m:
            constants[m.group(1)] = int(m.group(2))
    for line in lines:
        parsed = _parse(line)
        if parsed and parsed[2] == "compare" and "direction=LT" in parsed[4] and len(parsed[3]) == 2:
            if parsed[3][1] in constants:
                return constants[parsed[3][1]]
    return None


def _callees(parsed, comps: dict) -> list[tuple[str, int, bool]]:
    """`(callee, times per call, trip count known)` for the computations one instruction calls."""
    rest = parsed[4]
    trip = _trip_count(rest, comps) if parsed[2] == "while" else 1
    out = [(callee, trip or 1, trip is not None) if kind == "body" else (callee, 1, True)
           for kind, callee in _CALLS.findall(rest)]
    for group in _BRANCHES.findall(rest):
        out += [(c.strip().lstrip("%"), 1, True) for c in group.split(",") if c.strip()]
    return out


def matmul_flops(hlo_text: str) -> tuple[float, int]:
    """`(FLOPs of every dot and convolution, each times how often it runs, the number of loops whose trip
    count is not known (their bodies counted once))`."""
    comps = computations(hlo_text)
    parsed = {name: [p for p in map(_parse, lines) if p] for name, lines in comps.items()}
    own, calls = {}, {}
    for name, instrs in parsed.items():
        shapes = {p[0]: p[1] for p in instrs}
        own[name] = sum(_instruction_flops(p, shapes) for p in instrs)
        calls[name] = [c for p in instrs for c in _callees(p, comps)]
    unknown = sum(1 for cs in calls.values() for _, _, known in cs if not known)
    times = collections.Counter({"ENTRY": 1.0})
    order, seen = [], set()

    def visit(name):  # post-order: callees first
        if name in seen or name not in comps:
            return
        seen.add(name)
        for callee, _, _ in calls[name]:
            visit(callee)
        order.append(name)

    visit("ENTRY")
    for name in reversed(order):  # callers before callees
        for callee, n, _ in calls[name]:
            times[callee] += times[name] * n
    return sum(own[name] * times[name] for name in order), unknown


def collectives(hlo_text: str) -> dict[str, int]:
    """`{kind: instructions}` of the cross-device collectives in the program text (a loop's body counted
    once; async pairs counted at their start)."""
    counts = collections.Counter()
    for lines in computations(hlo_text).values():
        for line in lines:
            parsed = _parse(line)
            if not parsed:
                continue
            op = parsed[2]
            base = op[:-len("-start")] if op.endswith("-start") else op
            if base in COLLECTIVES:
                counts[base] += 1
    return dict(sorted(counts.items()))


_BYTES = {"pred": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8}


def largest_arrays(hlo_text: str, k: int = 5) -> list[tuple[int, str, str]]:
    """The `k` largest array results in the program, `(bytes, shape, jax op name)`, one per op name: where
    the memory goes when a compile runs out of it (the shapes as the program has them, before partitioning)."""
    best = {}
    for line in hlo_text.splitlines():
        m = re.match(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*((pred|bf16|f\d+|[su]\d+)\[([\d,]*)\])", line)
        if not m:
            continue
        dtype = m.group(2)
        size = _BYTES.get(dtype, int(re.sub(r"\D", "", dtype) or 32) // 8)
        n = math.prod(_dims(m.group(3))) * size
        op = re.search(r'op_name="([^"]+)"', line)
        name = op.group(1) if op else "?"
        if n > best.get(name, (0,))[0]:
            best[name] = (n, m.group(1), name)
    return sorted(best.values(), reverse=True)[:k]
