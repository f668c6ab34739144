"""FLOPs and bytes of a compiled XLA program, its loops counted as many times as they run.

`compiled.cost_analysis()` (XLA's HloCostAnalysis) counts a while loop's body once: a decode
loop's token step once, and within it one of the model's layers, the layer loop being a loop too.
This reads the optimized module's text (`compiled.as_text()`) instead and adds up, op by op as
the chip runs them (a fusion is one op), the bytes each reads and writes and the FLOPs of its
matmuls, a loop's body times its trip count. A loop whose trip count depends on the data (the
decode loop stops when every row is done) is counted once per iteration and reported apart, so
a decode program's figures come out per token step.

Bytes are logical bytes (no tile padding): an op reads its operands and writes its result; an
operand only sliced inside a fusion (a layer's weights out of the stacked ones, a layer's KV
cache) is read at the slice's size; an in-place `dynamic-update-slice` writes only its update, and
a buffer a fusion passes through to its output moves nothing. FLOPs are the matmuls' (a
convolution's taps that land on padding or a dilation's holes not counted) and one per element
of elementwise ops and reductions. With every trip count taken as 1, FLOPs match
`cost_analysis()`'s (tests/test_hlo_cost.py); bytes match it on CPU, while XLA:TPU's cost model
counts more than the logical bytes (1.6x at Qwen2.5-0.5B's decode, 3-5x on small loop-free
programs; bench.decode_bytes prints the ratio), so a floor to compare with is logical bytes too.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Iterable

import numpy as np

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
    "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
# ops that move no bytes of their own: views, tuples, control
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id",
    "opt-barrier", "iota", "add-dependency", "domain", "copy-start", "copy-done", "send-done", "recv-done",
}  # fmt: skip
_ELEMENTWISE = {
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "power", "remainder", "atan2", "and", "or", "xor",
    "not", "negate", "abs", "sign", "compare", "select", "clamp", "exponential", "exponential-minus-one", "log",
    "log-plus-one", "sqrt", "rsqrt", "cbrt", "tanh", "logistic", "sine", "cosine", "tan", "floor", "ceil",
    "round-nearest-afz", "round-nearest-even", "is-finite", "shift-left", "shift-right-logical",
    "shift-right-arithmetic", "popcnt", "clz", "erf",
}  # fmt: skip
# the inner ops that name a fusion in the per-op lists
_HEAVY = ("dot", "convolution", "dynamic-update-slice", "reduce", "gather", "scatter", "sort", "copy", "fusion")
# custom calls that move no bytes: a buffer's allocation, views, sharding annotations
_NO_OP_CALLS = {"AllocateBuffer", "ConcatBitcast", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _type_bytes(text: str) -> float:
    """Bytes of a shape or tuple of shapes as HLO writes it: `bf16[24,64]{1,0}`, `(s32[], f32[8])`."""
    arrays = _ARRAY.findall(text)
    return sum(_DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in arrays)


def _dims(text: str) -> list[int]:
    m = _ARRAY.search(text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    depth, pairs = 0, {"(": ")", "[": "]", "{": "}"}
    closing = set(pairs.values())
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            depth += 1
        elif c in closing:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, []
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


@dataclasses.dataclass
class Instr:
    name: str
    type: str
    op: str
    operands: list[str]
    attrs: str
    root: bool

    @property
    def bytes(self) -> float:
        return _type_bytes(self.type)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{re.escape(key)}=(%?[\w.\-]+|\{{[^}}]*\}}|\"[^\"]*\")", self.attrs)
        return m.group(1).lstrip("%").strip('"') if m else None


@dataclasses.dataclass
class Computation:
    name: str
    instrs: dict[str, Instr]
    order: list[str]
    entry: bool = False

    @property
    def root(self) -> Instr:
        return next(i for i in self.instrs.values() if i.root)

    def users(self, name: str) -> list[tuple[Instr, int]]:
        return [(i, k) for i in self.instrs.values() for k, o in enumerate(i.operands) if o == name]

    def params(self) -> list[Instr]:
        ps = [i for i in self.instrs.values() if i.op == "parameter"]
        return sorted(ps, key=lambda i: int(re.search(r"\d+", i.operands[0] if i.operands else "0").group()))


def parse(text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name."""
    comps: dict[str, Computation] = {}
    cur: Computation | None = None
    for raw in text.splitlines():
        line = _COMMENT.sub("", raw).rstrip()
        if cur is None:
            m = _HEADER.match(line)
            if m:
                cur = Computation(m.group(2), {}, [], entry=bool(m.group(1)))
            continue
        if line.strip() == "}":
            comps[cur.name] = cur
            cur = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
        if rest.startswith("("):
            end = _balanced(rest, 0)
        else:
            end = rest.find(" ")
        typ, rest = rest[:end], rest[end:].lstrip()
        # the layout in braces after the shape belongs to the type
        while rest.startswith("{"):
            e = _balanced(rest, 0)
            typ, rest = typ + rest[:e], rest[e:].lstrip()
        op_end = rest.find("(")
        if op_end < 0:
            continue
        op = rest[:op_end].strip()
        close = _balanced(rest, op_end)
        args = rest[op_end + 1 : close - 1]
        attrs = rest[close:]
        if op == "parameter" or op == "constant":
            operands = [args.strip()]
        else:
            operands = [a.strip().split()[-1].lstrip("%") for a in _split_top(args) if a.strip()]
        cur.instrs[name] = Instr(name, typ, op, operands, attrs, root)
        cur.order.append(name)
    return comps


@dataclasses.dataclass
class Cost:
    flops: float = 0.0
    bytes: float = 0.0
    collective_bytes: float = 0.0

    def __iadd__(self, other: "Cost") -> "Cost":
        self.flops += other.flops
        self.bytes += other.bytes
        self.collective_bytes += other.collective_bytes
        return self

    def times(self, n: float) -> "Cost":
        return Cost(self.flops * n, self.bytes * n, self.collective_bytes * n)


@dataclasses.dataclass
class OpCost:
    """One op as the chip runs it, in the computation it runs from, with how often it runs per
    run of the part reported (`count`: the product of the known trip counts around it)."""

    name: str
    op: str
    what: str  # the fusion's kind and its heaviest inner op, or the op itself
    shape: str
    computation: str
    count: float
    flops: float
    bytes: float
    source: str  # the JAX op it came from (metadata op_name)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Analysis:
    """A program's cost: `once` (outside any loop whose trip count depends on the data) and
    `per_iteration` of the outermost such loop (the decode loop's token step), with the ops
    behind each; `loops` the known trip counts used."""

    once: Cost
    per_iteration: Cost | None  # the dearest of `iterations`
    ops_once: list[OpCost]
    ops_per_iteration: list[OpCost]
    loops: dict[str, int | None]
    # every data-bound loop outside the others, in program order (the decode loop's phases,
    # sampler.phase_steps), one iteration's cost and ops each
    iterations: list[Cost] = dataclasses.field(default_factory=list)
    ops_by_iteration: list[list[OpCost]] = dataclasses.field(default_factory=list)

    def weighted(self, steps: list[int]) -> tuple[Cost, list[OpCost]]:
        """The mean iteration over the data-bound loops run `steps[j]` times each (sampler.phase_steps
        for a decode program), and its ops (each op's `count` scaled by its loop's share)."""
        if len(steps) != len(self.iterations):
            raise ValueError(f"{len(self.iterations)} data-bound loops, {len(steps)} step counts")
        total = sum(steps)
        mean = _sum(c.times(n / total) for c, n in zip(self.iterations, steps))
        ops = [
            dataclasses.replace(o, count=o.count * n / total)
            for loop_ops, n in zip(self.ops_by_iteration, steps)
            for o in loop_ops
        ]
        return mean, ops


class _Analyser:
    def __init__(self, comps: dict[str, Computation]):
        self.comps = comps
        self.loops: dict[str, int | None] = {}
        self.flat = False  # every loop body once, as cost_analysis() counts

    # -- bytes one fusion reads of an operand -------------------------------------------------

    def _read(self, comp: Computation, name: str, full: float, depth: int = 0, outer=()) -> float:
        """Bytes read of value `name` in `comp` (a fused computation): its slices' sizes where it
        is only sliced, nothing where it is only updated in place, all of it otherwise. `outer`:
        the (computation, fusion) pairs a nested fusion sits in, for a value its root passes out."""
        if depth > 16:
            return full
        total = 0.0
        users = comp.users(name)
        if not users:  # passed out of a nested fusion as its result: read as the outer fusion uses it
            if outer and comp.instrs.get(name) is not None and comp.instrs[name].root:
                (oc, oi), rest = outer[-1], outer[:-1]
                return self._read(oc, oi.name, full, depth + 1, rest)
            return full
        for user, k in users:
            if user.op in ("dynamic-slice", "slice", "gather") and k == 0:
                total += user.bytes
            elif user.op == "dynamic-update-slice" and k == 0:
                total += 0.0
            elif user.op == "tuple" and user.root and not outer:  # passed through to the output, aliased
                total += 0.0
            elif user.op in ("bitcast", "get-tuple-element") or (user.op == "reshape" and k == 0):
                total += self._read(comp, user.name, full, depth + 1, outer)
            elif user.op == "fusion":
                inner = self.comps.get(user.attr("calls") or "")
                ps = inner.params() if inner else []
                if inner and k < len(ps):
                    total += self._read(inner, ps[k].name, full, depth + 1, (*outer, (comp, user)))
                else:
                    total += full
            else:
                total += full
            if total >= full:
                return full
        return total

    def _written(self, comp: Computation, instr: Instr, depth: int = 0) -> float:
        """Bytes a fusion's root writes: an in-place update writes only its update."""
        if depth > 16:
            return instr.bytes
        if instr.op == "dynamic-update-slice":
            return comp.instrs[instr.operands[1]].bytes if instr.operands[1] in comp.instrs else instr.bytes
        if instr.op == "tuple":
            return sum(
                self._written(comp, comp.instrs[o], depth + 1)
                for o in instr.operands
                if o in comp.instrs and not self._passed(comp, comp.instrs[o])
            )
        if instr.op == "bitcast" and instr.operands[0] in comp.instrs:
            return self._written(comp, comp.instrs[instr.operands[0]], depth + 1)
        if instr.op == "fusion":
            inner = self.comps.get(instr.attr("calls") or "")
            if inner is not None:
                return self._written(inner, inner.root, depth + 1)
        return instr.bytes

    def _passed(self, comp: Computation, instr: Instr) -> bool:
        """A fusion's output that is one of its parameters (through views): the buffer passes
        through, aliased (TPU fusions that overlap an asynchronous collective with a matmul)."""
        while instr.op in ("bitcast", "get-tuple-element") and instr.operands[0] in comp.instrs:
            instr = comp.instrs[instr.operands[0]]
        return instr.op == "parameter"

    # -- FLOPs inside a fusion (or of a top-level op) ---------------------------------------------

    def _flops(self, comp: Computation, instr: Instr) -> float:
        op = instr.op
        if op == "fusion":
            inner = self.comps.get(instr.attr("calls") or "")
            return sum(self._flops(inner, i) for i in inner.instrs.values()) if inner else 0.0
        out = math.prod(_dims(instr.type)) if _ARRAY.search(instr.type) else 0
        if op == "dot":
            lhs = comp.instrs.get(instr.operands[0])
            contracting = instr.attr("lhs_contracting_dims") or "{}"
            idx = [int(x) for x in re.findall(r"\d+", contracting)]
            dims = _dims(lhs.type) if lhs else []
            return 2.0 * out * math.prod(dims[i] for i in idx if i < len(dims))
        if op == "convolution":
            return self._conv_flops(comp, instr, out)
        if op in _ELEMENTWISE:
            return float(out)
        if op in ("reduce", "reduce-window"):
            src = comp.instrs.get(instr.operands[0])
            return float(math.prod(_dims(src.type))) if src else 0.0
        return 0.0

    def _conv_flops(self, comp: Computation, instr: Instr, out: int) -> float:
        """2 x the multiply-adds of a convolution (XLA:TPU writes dots as convolutions): per
        spatial dimension, the (output, window tap) pairs that land on a real input element, not
        on padding or a dilation's hole; times the batch, the output features and the kernel's
        input features."""
        lhs, rhs = (comp.instrs.get(o) for o in instr.operands[:2])
        m = re.search(r"dim_labels=([\w>\-]+)", instr.attrs)
        if lhs is None or rhs is None or not m or "->" not in m.group(1):
            return 0.0
        ins, out_labels = m.group(1).split("->")
        lhs_labels, rhs_labels = ins.split("_")
        ldims, rdims, odims = _dims(lhs.type), _dims(rhs.type), _dims(instr.type)
        if len(lhs_labels) != len(ldims) or len(rhs_labels) != len(rdims) or len(out_labels) != len(odims):
            return 0.0
        spatial = [c for c in out_labels if c.isdigit()]
        window = {}
        w = re.search(r"window=\{([^}]*)\}", instr.attrs)
        for part in w.group(1).split() if w else []:
            key, _, val = part.partition("=")
            window[key] = val.split("x")

        def per_dim(key: str, i: int, default: str) -> str:
            vals = window.get(key)
            return vals[i] if vals and i < len(vals) else default

        macs = out * (rdims[rhs_labels.index("i")] if "i" in rhs_labels else 1)
        for i, c in enumerate(spatial):
            o_size, l_size = odims[out_labels.index(c)], ldims[lhs_labels.index(c)]
            k_size = int(per_dim("size", i, str(rdims[rhs_labels.index(c)])))
            stride, ld, rd = (int(per_dim(k, i, "1")) for k in ("stride", "lhs_dilate", "rhs_dilate"))
            pad_lo = int(per_dim("pad", i, "0_0").split("_")[0])
            if o_size * k_size > 20_000_000:  # too many pairs to count: every tap, holes aside
                pairs = o_size * math.ceil(k_size / ld)
            else:
                pos = np.arange(o_size)[:, None] * stride + np.arange(k_size)[None, :] * rd - pad_lo
                pairs = int(np.count_nonzero((pos >= 0) & (pos % ld == 0) & (pos // ld < l_size)))
            macs = macs / o_size * pairs
        return 2.0 * macs

    def _source(self, instr: Instr) -> str:
        m = re.search(r'op_name="([^"]*)"', instr.attrs)
        return m.group(1) if m else ""

    def _what(self, instr: Instr) -> str:
        if instr.op != "fusion":
            return instr.op
        inner = self.comps.get(instr.attr("calls") or "")
        kind = (instr.attr("kind") or "").removeprefix("k").lower()
        if inner is None:
            return f"fusion ({kind})"
        heavy = [i.op for i in inner.instrs.values() if i.op in _HEAVY]
        return f"{kind} fusion" + (f": {', '.join(sorted(set(heavy)))}" if heavy else "")

    # -- one op at the top level of a computation that runs ----------------------------------

    def _op(self, comp: Computation, instr: Instr) -> Cost:
        op = instr.op
        if op in _FREE or op.endswith("-start") or op.endswith("-update"):
            return Cost()
        if op.endswith("-done"):  # an asynchronous op: what it reads, what it writes
            collective = instr.bytes if op.startswith(_COLLECTIVES) else 0.0
            return Cost(0.0, 2 * instr.bytes, collective)
        if op == "custom-call" and (instr.attr("custom_call_target") or "").strip('"') in _NO_OP_CALLS:
            return Cost()
        if op == "fusion":
            inner = self.comps.get(instr.attr("calls") or "")
            read = 0.0
            ps = inner.params() if inner else []
            for k, o in enumerate(instr.operands):
                full = comp.instrs[o].bytes if o in comp.instrs else 0.0
                read += self._read(inner, ps[k].name, full) if inner and k < len(ps) else full
            written = self._written(inner, inner.root) if inner else instr.bytes
            return Cost(self._flops(comp, instr), read + written)
        if op == "dynamic-update-slice":
            upd = comp.instrs.get(instr.operands[1])
            u = upd.bytes if upd else 0.0
            return Cost(0.0, 2 * u)
        if op in ("dynamic-slice", "slice", "copy", "transpose", "reshape", "broadcast", "pad", "concatenate"):
            src = sum(comp.instrs[o].bytes for o in instr.operands if o in comp.instrs)
            read = min(src, instr.bytes) if op in ("dynamic-slice", "slice") else src
            return Cost(0.0, read + instr.bytes)
        operands = sum(comp.instrs[o].bytes for o in instr.operands if o in comp.instrs)
        c = Cost(self._flops(comp, instr), operands + instr.bytes)
        if any(op.startswith(k) for k in _COLLECTIVES):
            c.collective_bytes = instr.bytes
        return c

    def _called(self, instr: Instr) -> list[Computation]:
        """The computations a call or conditional runs."""
        branches = re.search(r"branch_computations=\{([^}]*)\}", instr.attrs)
        names = branches.group(1).split(",") if branches else [instr.attr("to_apply") or instr.attr("calls") or ""]
        names += [n for k in ("true_computation", "false_computation") if (n := instr.attr(k))]
        return [self.comps[n.strip().lstrip("%")] for n in names if n.strip().lstrip("%") in self.comps]

    def trip_count(self, instr: Instr) -> int | None:
        """A while loop's trip count: XLA's annotation, else a condition `i < constant` of a loop
        counting from 0 by 1 (a scan's or fori_loop's); None when the data decides it."""
        m = re.search(r'known_trip_count[^0-9]*"?n"?\s*:\s*"?(\d+)', instr.attrs)
        if m:
            return int(m.group(1))
        cond = self.comps.get(instr.attr("condition") or "")
        if cond is None:
            return None
        root = cond.root
        while root.op in ("bitcast", "copy") and root.operands[0] in cond.instrs:
            root = cond.instrs[root.operands[0]]
        if root.op == "fusion":
            inner = self.comps.get(root.attr("calls") or "")
            cond, root = (inner, inner.root) if inner else (cond, root)
        if root.op != "compare" or "direction=LT" not in root.attrs:
            return None
        rhs = cond.instrs.get(root.operands[1])
        lhs = cond.instrs.get(root.operands[0])
        if rhs is None or rhs.op != "constant" or lhs is None or lhs.op not in ("get-tuple-element", "parameter"):
            return None
        try:
            return int(rhs.operands[0])
        except ValueError:
            return None

    def walk(self, comp: Computation, count: float, sink: list[OpCost], inner_loops: list) -> Cost:
        """The cost of running `comp` once; ops appended to `sink` with `count` runs each. The
        bodies of loops whose trip count the data decides are collected in `inner_loops`."""
        total = Cost()
        for name in comp.order:
            instr = comp.instrs[name]
            if instr.op == "while":
                body = self.comps[instr.attr("body") or ""]
                cond = self.comps.get(instr.attr("condition") or "")
                n = 1 if self.flat else self.trip_count(instr)
                self.loops[instr.name] = n
                if n is None:
                    inner_loops.append((instr, body, cond))
                    continue
                total += self.walk(body, count * n, sink, inner_loops).times(n)
                if cond is not None:
                    runs = 1 if self.flat else n + 1
                    total += self.walk(cond, count * runs, sink, inner_loops).times(runs)
                continue
            if instr.op in ("call", "conditional"):
                called = self._called(instr)
                if called:  # a call: its computation; a conditional: its dearest branch
                    costs = [self.walk(c, count, sink, inner_loops) for c in called]
                    total += max(costs, key=lambda c: c.bytes) if instr.op == "conditional" else _sum(costs)
                    continue
            c = self._op(comp, instr)
            if c.bytes or c.flops:
                shape = instr.type.split("{")[0]
                what, source = self._what(instr), self._source(instr)
                sink.append(OpCost(instr.name, instr.op, what, shape, comp.name, count, c.flops, c.bytes, source))
            total += c
        return total


def _sum(costs: Iterable[Cost]) -> Cost:
    out = Cost()
    for c in costs:
        out += c
    return out


def analyse(hlo_text: str) -> Analysis:
    """The cost of an optimized HLO module (`compiled.as_text()`), see the module's docstring."""
    comps = parse(hlo_text)
    entry = next(c for c in comps.values() if c.entry)
    a = _Analyser(comps)
    ops_once: list[OpCost] = []
    loops: list = []
    once = a.walk(entry, 1, ops_once, loops)
    per_iter, ops_iter, costs, op_lists = None, [], [], []
    if loops:  # the data-bound loop that costs most per iteration (the decode loop)
        best = None
        for instr, body, cond in sorted(loops, key=lambda loop: _position(entry, comps, loop[0].name)):
            sink: list[OpCost] = []
            nested: list = []
            c = a.walk(body, 1, sink, nested)
            if cond is not None:
                c += a.walk(cond, 1, sink, nested)
            for _, b2, c2 in nested:  # loops inside it whose trip count the data decides: once each
                c += a.walk(b2, 1, sink, [])
                if c2 is not None:
                    c += a.walk(c2, 1, sink, [])
            costs.append(c)
            op_lists.append(sink)
            if best is None or c.bytes > best[0].bytes:
                best = (c, sink)
        per_iter, ops_iter = best
    return Analysis(once, per_iter, ops_once, ops_iter, a.loops, costs, op_lists)


def _position(entry: Computation, comps: dict[str, Computation], name: str) -> int:
    """Where a loop runs in program order: its index in the entry computation, or that of the op
    of the entry that calls the computation holding it."""
    if name in entry.instrs:
        return entry.order.index(name)
    for i, n in enumerate(entry.order):
        called = re.findall(r"(?:calls|to_apply|body)=%?([\w.\-]+)", entry.instrs[n].attrs)
        if any(name in comps[c].instrs for c in called if c in comps):
            return i
    return len(entry.order)


def once_each(hlo_text: str) -> Cost:
    """The same figures with every loop's body counted once, as XLA's cost_analysis() counts
    them: to check this reader against XLA's own."""
    comps = parse(hlo_text)
    entry = next(c for c in comps.values() if c.entry)
    a = _Analyser(comps)
    a.flat = True
    return a.walk(entry, 1, [], [])
