"""Dry run: ATen program -> the same program with a keep-whole plan.

A backend asks to keep some ops whole (not decomposed) because it converts
them well. Stock ExecuTorch decides that on the ATen graph, before
partitioning; when such an op then lands on the CPU (a uint8 rule moved it, a
refused dtype, a skip list), it has no CPU kernel and the `.pte` fails at load
(`kernel 'aten::matmul.out' not found`). The dry run decomposes the program
exactly as the decompose stage will, runs the backend's real partition search
on that throwaway Edge program, and keeps whole only the nodes that are
delegated there, or that have a CPU kernel anyway.

It is skipped when nothing can change: nothing to keep whole, every kept op
has a CPU kernel, or the backend says it takes every kept node.

A node whose output size depends on the data (an unbacked symbol such as `u0`:
a boolean-mask index, `nonzero`) is never kept whole, whatever the backend asks:
renamed into the no-decompose namespace it is traced with its meta kernel, which
cannot make such a size (`UnsupportedOperatorException: EDGE_DO_NOT_DECOMP.index.Tensor`
for SmolVLA's patch-position merge kept whole for Core ML), nor is an index by a boolean
mask whose size a check fixed (Gemma 3's image-token merge). Nor is a node that
passes a Python number where its schema takes a Tensor (`div.Tensor_mode(i, 3)`).

The backend is asked about the nodes that exist, and an op it keeps whole may exist only
inside another op's decomposition (`aten.lstm` makes a `linear` per step, which XNNPACK
keeps whole). Such composites are opened first (decomposed one level, their decomposition
traced on meta tensors to find them), and the plan is made on the opened program: else
those linears became permute + addmm, which XNNPACK refuses (its weight is no longer a
parameter), and every step's matrix multiply ran on the CPU between two delegates.
"""

from __future__ import annotations

import logging
import time

import attrs
import torch
from torch.export import ExportedProgram
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from compiler.backends.base import Backend
from compiler.ir.artifacts import AtenProgram, EdgeProgram, KeepWholePlan, PlannedProgram
from compiler.ir.dialect import op_name
from compiler.ir.graph import call_nodes
from compiler.ir.kernels import missing_kernel
from compiler.stages.base import Stage, StageContext
from compiler.passes.decomposition import full_decomposition_table, keepable, to_edge_program
from compiler.passes.partitioning import partition
from compiler.passes.tracing import unbacked_symbols_kept_in
from compiler.reporting.report import Metric, counted

logger = logging.getLogger(__name__)


def _traced_by_meta_kernel(why: str, size: str) -> str:
    return f"{why}: kept whole, it would be traced with its meta kernel, which cannot make {size}"


def data_dependent_size(node: torch.fx.Node) -> str | None:
    """Why `node` cannot be kept whole because its output size depends on the data, or None."""
    symbols = free_unbacked_symbols(node.meta.get("val"))
    if not symbols:
        return None
    return _traced_by_meta_kernel(
        f"its output size depends on the data ({', '.join(sorted(map(str, symbols)))})", "such a size"
    )


def boolean_mask_index(node: torch.fx.Node) -> str | None:
    """Why `node` cannot be kept whole because it indexes by a boolean mask: its size is the
    mask's count, even where a size check fixed it (`torch._check(x[mask].numel() == n)`,
    as transformers' image-token merge does, leaves no data-dependent symbol to see)."""
    if node.target is not torch.ops.aten.index.Tensor:
        return None
    masks = [i for i in node.args[1] if isinstance(i, torch.fx.Node) and i.meta["val"].dtype in (torch.bool, torch.uint8)]
    if not masks:
        return None
    return _traced_by_meta_kernel(
        f"it indexes by the boolean mask {masks[0].name}", "a size that depends on the mask's values"
    )


def number_for_a_tensor(node: torch.fx.Node) -> str | None:
    """Why `node` cannot be kept whole because it passes a Python number where its schema
    takes a Tensor (`torch.div(i, 3, rounding_mode="floor")` is recorded as
    `div.Tensor_mode(i, 3)`): decomposition wraps the number, but renamed into the
    no-decompose namespace the op is called under its own schema, which refuses it."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    for position, argument in enumerate(schema.arguments):
        if not isinstance(argument.type, torch.TensorType):
            continue
        value = node.kwargs.get(argument.name, node.args[position] if position < len(node.args) else None)
        if isinstance(value, (bool, int, float)):
            return (
                f"it passes the number {value} as its Tensor argument '{argument.name}': kept whole, "
                "it would be called under its own schema, which refuses a number there"
            )
    return None


# Each: node -> why it cannot be kept whole whatever the backend asks, or None.
_CANNOT_KEEP_WHOLE = (data_dependent_size, boolean_mask_index, number_for_a_tensor)


def requested_nodes(program: ExportedProgram, backend: Backend) -> tuple[list[torch.fx.Node], dict[str, str]]:
    """The ATen nodes the backend asks to keep whole that can be, and why the others cannot."""
    keep = backend.keep_whole(program)
    ops = keepable(keep.ops) if keep.ops else set()
    asked = [
        node
        for node in call_nodes(program)
        if node.target in ops and (keep.node_filter is None or keep.node_filter(node))
    ]
    refused = {}
    for node in asked:
        why = next((reason for rule in _CANNOT_KEEP_WHOLE if (reason := rule(node))), None)
        if why:
            refused[node.name] = why
    return [node for node in asked if node.name not in refused], refused


# --- composites holding kept ops: opened before the plan is made -------------------------


def _meta_value(value):
    """A meta tensor like `value` (a SymInt size by its hint), or `value` itself."""
    if isinstance(value, torch.SymInt):
        return value.node.hint if value.node.hint is not None else 2
    if not isinstance(value, torch.Tensor):
        return value
    shape = [s if isinstance(s, int) else (s.node.hint if s.node.hint is not None else 2) for s in value.shape]
    return torch.empty(shape, dtype=value.dtype, device="meta")


def _signature(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(_signature, value))}]"
    return repr(value)


# (decomposition, the signature of its arguments) -> the ops it makes: the same op over
# the same shapes is traced once per process (compiling a model again, or each backend).
_MADE: dict[tuple, frozenset | None] = {}


def ops_made_by(decomposition, node: torch.fx.Node) -> frozenset | None:
    """The ops `decomposition` makes of `node`, traced on meta tensors before dispatch (where
    `linear` is still `linear`), or None if the trace fails."""
    args = torch.fx.node.map_arg(node.args, lambda a: _meta_value(a.meta.get("val")))
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: _meta_value(a.meta.get("val")))
    key = (decomposition, _signature(args), _signature(sorted(kwargs.items())))
    if key not in _MADE:
        try:
            traced = make_fx(lambda *a: decomposition(*a, **kwargs), pre_dispatch=True)(*args)
            _MADE[key] = frozenset(n.target for n in traced.graph.nodes if n.op == "call_function")
        except Exception as exc:  # a probe: the program is decomposed as before
            logger.debug("could not trace the decomposition of %s: %s", node.name, exc)
            _MADE[key] = None
    return _MADE[key]


def composites_holding(program: ExportedProgram, keep_ops: set) -> dict:
    """Op -> its decomposition, for each op of `program` the backend does not keep whole
    whose decomposition makes an op it does and a table would decompose (`aten.lstm` makes
    `linear`s). A kept core op (`index`, `full`) is left whole anyway: opening a composite
    for it gains nothing, and costs a retrace that turns `reshape` into `view` (which the
    full decomposition after it can fail on, as SmolVLM's vision tower did for Core ML)."""
    if not keep_ops:
        return {}
    table = full_decomposition_table()
    decomposed = {op for op in keep_ops if op in table}
    if not decomposed:
        return {}
    found, probed = {}, set()
    for node in call_nodes(program):
        op = node.target
        if op in keep_ops or op in probed or op not in table:
            continue
        probed.add(op)
        made = ops_made_by(table[op], node)
        if made and (made - {op}) & decomposed:
            found[op] = table[op]
    return found


def open_composites(program: ExportedProgram, backend: Backend) -> tuple[ExportedProgram, list[str]]:
    """`program` with every composite holding an op the backend keeps whole decomposed one
    level, so the plan can keep those ops (`requested_nodes` sees only nodes that exist);
    and the ops opened. Stock reaches them with a first decomposition that spares every op
    its partitioner names; without this an LSTM's linears became permute + addmm, which
    XNNPACK refuses (the weight is no longer a parameter), and ran on the CPU."""
    keep = backend.keep_whole(program)
    composites = composites_holding(program, keepable(keep.ops) if keep.ops else set())
    if not composites:
        return program, []
    with unbacked_symbols_kept_in(program):
        opened = program.run_decompositions(composites)
    return opened, sorted(op_name(op) for op in composites)


def _aten_origin(node: torch.fx.Node) -> str:
    """The name of the ATen node an Edge node was made from."""
    sources = node.meta.get("from_node") or []
    if not sources:
        return node.name
    source = sources[-1]
    while source.from_node:
        source = source.from_node[-1]
    return source.name


def dry_run(
    program: ExportedProgram, backend: Backend, kept: list[torch.fx.Node], state: frozenset[str] = frozenset(),
    fallbacks: list[str] | None = None,
) -> tuple[dict[str, str], EdgeProgram, dict[str, float]]:
    """Decompose as the decompose stage will, partition, and say which kept nodes to drop
    (ATen node name -> why it is decomposed after all); also the decomposition made, with
    its partition search in `searched`, and the seconds each took."""
    names = {n.name for n in kept}
    start = time.perf_counter()
    edge = to_edge_program(program, names, fallbacks)
    decomposing = time.perf_counter() - start
    # The search runs on a copy (the backend may rewrite what it partitions, as Core ML
    # does with rank-6 chains), so the Edge program stays a pure decomposition.
    searched = partition(edge, backend, state)
    seconds = {"decomposition_handed_on_s": decomposing, "search_handed_on_s": time.perf_counter() - start - decomposing}
    placement = {p.node: p for p in searched.plan.nodes}
    dropped = {}
    for node in call_nodes(searched.program):
        origin = _aten_origin(node)
        where = placement.get(node.name)
        if origin not in names or where is None or not where.on_cpu:
            continue
        kernel = missing_kernel(node.target)
        if kernel:
            dropped[origin] = (
                f"kept whole it would run on the CPU ({where.reason}), where the runtime has no "
                f"{kernel}; decomposed instead"
            )
    return dropped, attrs.evolve(edge, searched=searched), seconds


def why_skip(program: ExportedProgram, backend: Backend, kept: list[torch.fx.Node], mode: str) -> tuple[str | None, str | None]:
    """(why the dry run can be skipped, why it must run): exactly one is None."""
    if mode == "never":
        return "you set dry_run_mode to never", None
    if not kept:
        return "nothing to keep whole", None
    if mode == "always":
        return None, "you set dry_run_mode to always"
    if not any(missing_kernel(n.target) for n in kept):
        return "every kept op has a CPU kernel", None
    because = backend.dry_run_needed(program, kept)
    return (None, because) if because else (f"the {backend.name} backend takes every kept op", None)


class DryRun(Stage, takes=AtenProgram, returns=PlannedProgram):
    metrics = (
        Metric("opened", "text", lambda ops: f"decomposed one level first, as they hold ops the backend keeps whole: {ops}"),
        Metric("kept", "count", lambda n: f"kept {counted(n, 'op')} whole for the backend" if n else "kept no op whole"),
        # `skipped` and `because` are sentences already.
        Metric("skipped", "text", lambda why: f"no dry run needed: {why}"),
        Metric("because", "text", lambda why: f"dry run needed: {why}"),
        Metric("retraced", "text", lambda why: f"decomposed by torch's retrace (node by node failed: {why})"),
        Metric("decomposed", "text", lambda ops: f"decomposed after all (would run on the CPU without a kernel): {ops}"),
        Metric("decomposition_handed_on_s", "s",
               lambda s: f"handed its decomposition ({s:.2f} s) on to the decompose stage"),
        Metric("search_handed_on_s", "s", lambda s: f"handed its partition search ({s:.2f} s) on to the partition stage"),
    )

    """Its answer is the keep-whole plan on the artifact it returns (saved in stage files):
    the later stages decompose and partition from that plan alone, so a resumed run and an
    uninterrupted one run the same code."""

    def apply(self, aten: AtenProgram, ctx: StageContext) -> PlannedProgram:
        program, opened = open_composites(aten.program, ctx.backend)
        if opened:
            ctx.metrics["opened"] = ", ".join(opened)
        kept, refused = requested_nodes(program, ctx.backend)
        skipped, because = why_skip(program, ctx.backend, kept, ctx.options.mode)
        ctx.metrics["kept"] = len(kept)
        if skipped:
            ctx.metrics["skipped"] = skipped
            return PlannedProgram(program, KeepWholePlan(frozenset(n.name for n in kept), refused, skipped))
        ctx.metrics["because"] = because
        fallbacks: list[str] = []
        with ctx.program_checks_skipped():
            dropped, edge, seconds = dry_run(program, ctx.backend, kept, ctx.program_state, fallbacks)
        if fallbacks:
            ctx.metrics["retraced"] = fallbacks[0]
        plan = KeepWholePlan(frozenset(n.name for n in kept) - set(dropped), {**refused, **dropped})
        ctx.metrics["kept"] = len(plan.nodes)
        if dropped:
            ctx.metrics["decomposed"] = ", ".join(sorted({op_name(n.target) for n in kept if n.name in dropped}))
            return PlannedProgram(program, plan)
        # Nothing dropped: the decomposition made here is the decompose stage's output, and
        # its search the partition stage's.
        ctx.metrics.update({name: round(s, 3) for name, s in seconds.items()})
        return PlannedProgram(program, plan, decomposed=edge)
