"""Reading a compiled XLA program: its collectives (with loop trip counts) and a Neuron census.

What cannot run here (64 NeuronCores, 3B weights) is proven by compiling it with abstract inputs
and reading the optimised HLO text (`jax.jit(f).lower(...).compile().as_text()`):

- `collectives(hlo)`: every all-gather, reduce-scatter, all-reduce, all-to-all and
  collective-permute, the bytes one device receives per execution (ring algorithms: a ring sends
  as many as it receives), multiplied by how often its computation runs (while loops carry a
  `known_trip_count`). XLA:CPU never forms a reduce-scatter: a sharded gradient compiles to an
  all-reduce whose only use is a dynamic-slice of this device's rows, which the GPU, TPU and
  Neuron compilers rewrite into a reduce-scatter. Such a pair is reported as `all-reduce` with
  `sliced=True`, and `as_reduce_scatter` counts it at the reduce-scatter's bytes. XLA:CPU also
  has no bf16 collectives: it moves bf16 data as f32 between two converts; such a collective
  (every use rounds it back to bf16) is counted at bf16 width, `widened_here=True`.
- `neuron_census(hlo)`: what the JAX Neuron plugin documents as unsupported or constrained
  (docs/design.md s1): conditionals, while loops without a static trip count, custom calls and host
  callbacks, variadic reductions (argmax/argmin), sort comparators, f64 and 64-bit integer
  tensors, and the RNG algorithm of any rng-bit-generator.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

COLLECTIVE_KINDS = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "collective-permute",
)
ITEMSIZE = {  # bytes per element of each HLO element type
    name: size
    for size, names in (
        (1, "pred s8 u8"),
        (2, "bf16 f16 s16 u16"),
        (4, "f32 s32 u32"),
        (8, "f64 s64 u64"),
    )
    for name in names.split()
}

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"\b(pred|[sfu]\d+|bf16)\[([\d,]*)\]")


def computations(hlo: str) -> tuple[dict[str, list[tuple[str, str, str, str]]], str]:
    """{computation name: [(instruction name, result type, opcode, rest of line)]}, entry name."""
    comps: dict[str, list] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if current is not None and m:
            comps[current].append(m.groups())
    return comps, entry


def trip_count(rest: str) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
    return int(m.group(1)) if m else None


def executions(hlo: str) -> dict[str, int]:
    """How many times each computation runs per execution of the entry (while bodies times their
    trip count; a loop without a known trip count counts once and shows in the census)."""
    comps, entry = computations(hlo)
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, instrs in comps.items():
        for _, _, op, rest in instrs:
            if op == "while":
                body = re.search(r"body=%?([\w.\-]+)", rest).group(1)
                calls[name].append((body, trip_count(rest) or 1))
            else:
                for callee in re.findall(
                    r"(?:calls|to_apply|branch_computations)=\{?%?([\w.\-]+)", rest
                ):
                    calls[name].append((callee, 1))
    runs: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int) -> None:
        runs[name] += times
        for callee, factor in calls.get(name, []):
            visit(callee, times * factor)

    visit(entry, 1)
    return dict(runs)


def _bytes(types: str) -> tuple[int, str]:
    shapes = _SHAPE.findall(types)
    total = sum(math.prod(int(d) for d in dims.split(",") if d) * ITEMSIZE[t] for t, dims in shapes)
    return total, "/".join(sorted({t for t, _ in shapes}))


def _group_size(rest: str, n_devices: int) -> int:
    """Devices in each replica group: `{{0,1,..}}` lists, `[G,S]<=[N]` iota groups, or the mesh
    form `mesh['axis_0'=4,'axis_1'=2], ... {'axis_0'}` (the product of the named axes)."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", rest)
    if mesh:
        sizes = dict((a, int(n)) for a, n in re.findall(r"'([\w]+)'=(\d+)", mesh.group(1)))
        return math.prod(sizes[a] for a in re.findall(r"'([\w]+)'", mesh.group(2)))
    explicit = re.search(r"replica_groups=\{\{([\d,]+)\}", rest)
    if explicit:
        return len(explicit.group(1).split(","))
    iota = re.search(r"replica_groups=\[\d+,(\d+)\]", rest)
    return int(iota.group(1)) if iota else n_devices


def _users(name: str, instrs) -> list[tuple[str, str]]:
    """(name, opcode) of the instructions that take %name as an operand."""
    ref = re.compile(rf"%{re.escape(name)}(?![\w.\-])")
    return [(n, op) for n, _, op, rest in instrs if ref.search(rest)]


def _only_sliced(name: str, instrs, comps, size: int) -> bool:
    """Every use of `name` (`size` bytes; through bitcasts and copies) keeps only a slice of it:
    a dynamic-slice, or a fusion that contains one and returns fewer bytes. That is the
    all-reduce + slice pattern of a sharded gradient on XLA:CPU."""
    users = _users(name, instrs)
    if not users:
        return False
    for user, op in users:
        types, rest = next((t, r) for n, t, _, r in instrs if n == user)
        if op in ("bitcast", "copy", "reshape", "all-reduce-done"):
            if not _only_sliced(user, instrs, comps, size):
                return False
        elif op == "fusion":
            fused = re.search(r"calls=%?([\w.\-]+)", rest).group(1)
            slices = any(o == "dynamic-slice" for _, _, o, _ in comps.get(fused, []))
            if not (slices and _bytes(types)[0] < size):
                return False
        elif op != "dynamic-slice":
            return False
    return True


def _elements(name: str, types: str, instrs, comps) -> list[tuple[int, str, bool]]:
    """(bytes, dtype, only sliced) of each element of an all-reduce's result: one for an array,
    one per tuple element for a combined all-reduce (read through its get-tuple-elements)."""
    shapes = _SHAPE.findall(types)
    sizes = [
        (math.prod(int(d) for d in dims.split(",") if d) * ITEMSIZE[t], t) for t, dims in shapes
    ]
    if not types.startswith("("):
        return [(*sizes[0], _only_sliced(name, instrs, comps, sizes[0][0]))]
    sliced = [False] * len(sizes)
    gtes = [u for u, op in _users(name, instrs) if op == "get-tuple-element"]
    for n, _, _, rest in instrs:
        if n in gtes:
            k = int(re.search(r"index=(\d+)", rest).group(1))
            sliced[k] = _only_sliced(n, instrs, comps, sizes[k][0])
    return [(b, t, s) for (b, t), s in zip(sizes, sliced, strict=True)]


def _narrowed_by_users(name: str, instrs, comps) -> bool:
    """Every use of an f32 collective result first rounds it to bf16: a `convert` op, or a fusion
    whose computation converts its parameter to bf16. That is XLA:CPU widening a bf16 collective
    (it has none) to f32 around a convert pair; GPU, TPU and Neuron move such data in bf16."""
    users = _users(name, instrs)
    if not users:
        return False
    for user, op in users:
        types, rest = next((t, r) for n, t, _, r in instrs if n == user)
        if op == "convert":
            if not types.startswith("bf16"):
                return False
        elif op in ("get-tuple-element", "bitcast", "copy", "reshape"):  # look through
            if not _narrowed_by_users(user, instrs, comps):
                return False
        elif op == "fusion":
            fused = comps.get(re.search(r"calls=%?([\w.\-]+)", rest).group(1), [])
            params = {n for n, _, o, _ in fused if o == "parameter"}
            if not any(
                o == "convert" and t.startswith("bf16") and r.split(")")[0].lstrip("%") in params
                for _, t, o, r in fused
            ):
                return False
        else:
            return False
    return True


def collectives(hlo: str, n_devices: int) -> list[dict]:
    """Every collective: kind, dtype, result bytes, group size, executions per program run, and
    the bytes one device receives per run of the program (`received`, all executions)."""
    comps, _ = computations(hlo)
    runs = executions(hlo)
    out = []
    for comp, instrs in comps.items():
        times = runs.get(comp, 0)
        for name, types, op, rest in instrs:
            kind = op.removesuffix("-start")
            if kind not in COLLECTIVE_KINDS:
                continue
            g = _group_size(rest, n_devices)
            op_name = re.search(r'op_name="([^"]*)"', rest)
            op_name = op_name.group(1) if op_name else ""
            if kind == "all-reduce":  # ring: reduce-scatter, then all-gather; per tuple element
                for size, dtype, sliced in _elements(name, types, instrs, comps):
                    received = 2 * (g - 1) * size // g
                    out.append(_entry(kind, dtype, size, g, times, received, sliced, op_name))
                continue
            size, dtype = _bytes(types)
            widened = dtype == "f32" and _narrowed_by_users(name, instrs, comps)
            if widened:  # a bf16 collective that XLA:CPU moves in f32: count the bf16 bytes
                size, dtype = size // 2, "bf16"
            if kind == "all-gather":  # result: the whole buffer, 1/g of it was here already
                received = (g - 1) * size // g
            elif kind == "reduce-scatter":  # result: this device's 1/g of the reduced buffer
                received = (g - 1) * size
            elif kind == "all-to-all":  # every device keeps its own 1/g
                received = (g - 1) * size // g
            else:
                received = size
            out.append(_entry(kind, dtype, size, g, times, received, False, op_name, widened))
    return out


def _entry(kind, dtype, size, group, times, received, sliced, op_name, widened=False) -> dict:
    return {
        "kind": kind,
        "op_name": op_name,  # the JAX name stack it was traced under (its metadata)
        "dtype": dtype,
        "bytes": size,
        "group": group,
        "executions": times,
        "received": received * times,
        "sliced": sliced,  # an all-reduce used only through a dynamic-slice
        "as_reduce_scatter": (received // 2 if sliced else received) * times,
        "widened_here": widened,  # bf16 data that XLA:CPU moved as f32 (twice the bytes)
    }


def collective_bytes(
    colls: list[dict], target_forms_reduce_scatter: bool = True, scopes: dict | None = None
) -> dict:
    """Bytes received per device per program run, by kind, as GPU/TPU/Neuron move them: an
    all-reduce used only through a dynamic-slice counts as the reduce-scatter it becomes there
    (half the bytes), and bf16 data at bf16 width. With `target_forms_reduce_scatter=False`,
    XLA:CPU's own program: all-reduces as all-reduces, widened bf16 collectives at f32 width.

    `scopes` {kind: name scope}: a collective traced under that `jax.named_scope` (its op_name;
    its autodiff transpose included) is counted under that kind instead of its op's, e.g.
    {"context-exchange": "context_exchange"}."""
    scopes = scopes or {}
    out = {k: 0 for k in (*COLLECTIVE_KINDS, *scopes)}
    for c in colls:
        own = next((k for k, scope in scopes.items() if scope in c["op_name"]), None)
        if target_forms_reduce_scatter and c["sliced"]:
            out[own or "reduce-scatter"] += c["as_reduce_scatter"]
        elif target_forms_reduce_scatter:
            out[own or c["kind"]] += c["received"]
        else:
            out[own or c["kind"]] += c["received"] * (2 if c["widened_here"] else 1)
    out["total"] = sum(out.values())
    return out


def collective_executions(colls: list[dict], scopes: dict) -> dict:
    """{name: how many collectives run per program run} of those traced under each name scope of
    `scopes` {name: scope} (autodiff transposes included; loops counted by their trip count)."""
    return {
        name: sum(c["executions"] for c in colls if scope in c["op_name"])
        for name, scope in scopes.items()
    }


def neuron_census(hlo: str) -> dict:
    """Counts of what the Neuron plugin does not support (docs/design.md s1), from optimised HLO."""
    comps, _ = computations(hlo)
    ops = [(op, types, rest) for instrs in comps.values() for _, types, op, rest in instrs]
    whiles = [trip_count(rest) for op, _, rest in ops if op == "while"]
    targets = sorted(
        {m for _, _, rest in ops for m in re.findall(r'custom_call_target="([^"]+)"', rest)}
    )
    callbacks = [t for t in targets if "callback" in t.lower()]
    host_io = sum(
        op in ("send", "recv", "infeed", "outfeed", "send-done", "recv-done") for op, _, _ in ops
    )
    variadic = sum(op == "reduce" and types.startswith("(") for op, types, _ in ops)
    sorts = [rest for op, _, rest in ops if op == "sort"]
    comparators = {m for rest in sorts for m in re.findall(r"to_apply=%?([\w.\-]+)", rest)}
    directions = sorted(
        {
            d
            for name in comparators
            for _, _, op, rest in comps.get(name, [])
            if op == "compare"
            for d in re.findall(r"direction=(\w+)", rest)
        }
    )
    rng = sorted(
        {
            m
            for op, _, rest in ops
            if op == "rng-bit-generator"
            for m in re.findall(r"algorithm=(\w+)", rest)
        }
    )
    census = {
        "conditionals": sum(op == "conditional" for op, _, _ in ops),
        "while_loops": len(whiles),
        "while_trip_counts": sorted(w for w in whiles if w is not None),
        "while_loops_without_static_trip_count": sum(w is None for w in whiles),
        "custom_call_targets": targets,
        "host_callbacks": len(callbacks) + host_io,
        "variadic_reductions": variadic,
        "sorts": len(sorts),
        "sort_comparator_directions": directions,
        "f64_tensors": sum("f64[" in types for _, types, _ in ops),
        "int64_tensors": sum(bool(re.search(r"\b[su]64\[", types)) for _, types, _ in ops),
        "rng_algorithms": rng,
    }
    census["violations"] = (
        census["conditionals"]
        + census["while_loops_without_static_trip_count"]
        + len(targets)
        + census["host_callbacks"]
        + variadic
        + census["f64_tensors"]
        + census["int64_tensors"]
    )
    return census
