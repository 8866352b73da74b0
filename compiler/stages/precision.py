"""Precision: the captured program computing in the floating dtype the backend runs fast.

A bfloat16 model on a backend without bfloat16 kernels (XNNPACK; Core ML, which converts
float32 programs and computes inside in its own compute precision) would run every op on
the portable CPU kernels. With precision `auto` such a program computes in float32, with
casts only at its edges: its bfloat16 inputs cast on entry, its outputs cast back, so it
takes and returns what the model does. `float32` and `float16` do the same for every
floating dtype, on any backend; `model` (and `auto` elsewhere) leaves the program alone, as
does every mode for a program with no op computing in a dtype to change (`computes_in`).

The rewrite, on a copy of the captured program:
- parameters, buffers and lifted constants of a changed dtype are stored in the new one
  (tensors shared by several names stay shared);
- every dtype argument that names a changed dtype names the new one: casts (`to`,
  `_to_copy`), factories (`full`, `zeros`, `arange`...), reductions' accumulation dtypes,
  and export's dtype assertions, which keep checking the program they are in;
- user inputs of a changed dtype are cast on entry, and user outputs the model returned in
  a changed dtype are cast back to it;
- `view(dtype)` reinterprets bits, so it reads its input in the model's dtype;
- the graph is traced again on fake tensors (every node's `meta["val"]`); a node that still
  makes a changed dtype (a bitcast to one) gets a cast after it.

Mutable buffers are state inside the program, never an input or output the caller sees,
so they change dtype like the weights: the state is kept and written in the dtype the
program computes in. A program run over several calls then follows the model run in that
dtype, and its state needs no cast on the CPU at each read and write. A user input the
model writes in place cannot be cast on entry (the write would reach the copy): such a
program is left alone under `auto`, and `float32` / `float16` refuse it.

`auto` never picks float16 for XNNPACK: its partitioner takes float16 linears but not GELU
nor the float32 <-> float16 casts, and on x86 without AVX512-FP16 its runtime computes
float16 right but slower than float32 (Linear-GELU-Linear 512-2048-512, 64 rows: 27 ms
against 11 ms). `precision float16` asks for it.
"""

from __future__ import annotations

import logging

import attrs
import torch
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from compiler.backends.base import Backend
from compiler.ir.artifacts import AtenProgram
from compiler.ir.errors import UserInputError
from compiler.ir.mapped import cast_into_file, is_mapped
from compiler.ir.graph import copy_program
from compiler.ir.invariants import plain_tensor
from compiler.ir.targets import BY_NAME
from compiler.stages.base import Stage, StageContext
from compiler.passes.folding import written_in_place
from compiler.reporting.report import Metric, counted

logger = logging.getLogger(__name__)

aten = torch.ops.aten

FLOATING = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

# Ops that reinterpret their input's bits: they must read it in the model's dtype.
_BITCASTS = frozenset({aten.view.dtype})


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@attrs.frozen
class Choice:
    """The dtypes a program stops computing in, the one it computes in instead, and why."""

    changed: frozenset[torch.dtype]
    dtype: torch.dtype | None  # None: the program stays as the model computes
    why: str


def choose(mode: str, backend: Backend) -> Choice:
    if mode == "model":
        return Choice(frozenset(), None, "as the model computes (precision model)")
    if mode != "auto":
        dtype = getattr(torch, mode)
        return Choice(FLOATING - {dtype}, dtype, f"every floating tensor became {mode} (precision {mode})")
    target = BY_NAME.get(backend.name)
    why = target.no_bfloat16 if target else None
    if why is None:
        return Choice(frozenset(), None, f"as the model computes: the {backend.name} backend computes bfloat16 itself")
    return Choice(frozenset({torch.bfloat16}), torch.float32, f"bfloat16 became float32: {why}")


def _tensor_dtypes(node: torch.fx.Node) -> set[torch.dtype]:
    return {leaf.dtype for leaf in pytree.tree_leaves(node.meta.get("val")) if isinstance(leaf, torch.Tensor)}


def _dtype_arguments(node: torch.fx.Node) -> set[torch.dtype]:
    return {a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, torch.dtype)}


def computes_in(ep: ExportedProgram, dtypes: frozenset[torch.dtype]) -> bool:
    """Whether an op of the program computes in one of `dtypes`: reads and makes values of it.
    A cast into one and back (a float32 model rounding through bfloat16) computes in none:
    that rounding is the model's, and costs the delegate nothing."""
    return any(
        _tensor_dtypes(n) & dtypes and any(_tensor_dtypes(a) & dtypes for a in n.all_input_nodes)
        for n in ep.graph.nodes
        if n.op == "call_function"
    )


def written_user_inputs(ep: ExportedProgram, dtypes: frozenset[torch.dtype]) -> list[str]:
    """User inputs of one of `dtypes` that the program writes in place."""
    written = written_in_place(ep) | {
        n for n in ep.graph.nodes if n.name in ep.graph_signature.user_inputs_to_mutate.values()
    }
    users = set(ep.graph_signature.user_inputs)
    return [n.name for n in written if n.op == "placeholder" and n.name in users and _tensor_dtypes(n) & dtypes]


def _cast(graph: torch.fx.Graph, value: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    cast = graph.call_function(aten._to_copy.default, (value,), {"dtype": dtype})
    cast.meta["stack_trace"] = value.meta.get("stack_trace")
    return cast


@attrs.define
class _Counts:
    tensors_converted: int = 0
    dtype_arguments: int = 0
    edge_casts: int = 0
    casts_added: int = 0
    # The casts made that keep the model's dtype (outputs, a bitcast's input): not cast again.
    model_dtype: set = attrs.field(factory=set)

    def metrics(self) -> dict[str, int]:
        """The counts that are not 0, for the report."""
        return attrs.asdict(self, filter=lambda _, value: isinstance(value, int) and value > 0)


def _convert_constants(ep: ExportedProgram, changed: frozenset, dtype: torch.dtype, counts: _Counts) -> None:
    """Store parameters, buffers and lifted constants of a changed dtype in `dtype`; their
    placeholders get fake values of the new tensors."""
    converted: dict[int, torch.Tensor] = {}
    for store in (ep.state_dict, ep.constants):
        for target, value in store.items():
            if not plain_tensor(value) or value.dtype not in changed:
                continue
            if id(value) not in converted:
                new = cast_into_file(value, dtype) if is_mapped(value) else value.detach().to(dtype)
                if isinstance(value, torch.nn.Parameter):
                    new = torch.nn.Parameter(new, requires_grad=value.requires_grad)
                converted[id(value)] = new
                counts.tensors_converted += 1
            store[target] = converted[id(value)]
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    fake_mode = detect_fake_mode([n.meta["val"] for n in placeholders.values()])
    for spec in ep.graph_signature.input_specs:
        value = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
        node = placeholders[spec.arg.name]
        if spec.kind != InputKind.USER_INPUT and plain_tensor(value) and _tensor_dtypes(node) & changed:
            node.meta["val"] = fake_mode.from_tensor(value, static_shapes=True)


def _retarget_dtype_arguments(graph: torch.fx.Graph, changed: frozenset, dtype: torch.dtype, counts: _Counts) -> None:
    """Dtype arguments naming a changed dtype name `dtype`; a bitcast reads the model's dtype."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _BITCASTS:
            source = node.args[0]
            (original,) = _tensor_dtypes(source)
            if original in changed:
                with graph.inserting_before(node):
                    cast = _cast(graph, source, original)
                node.replace_input_with(source, cast)
                counts.model_dtype.add(cast)
                counts.casts_added += 1
            continue
        if not _dtype_arguments(node) & changed:
            continue
        node.args, node.kwargs = pytree.tree_map_only(
            torch.dtype, lambda d: dtype if d in changed else d, (node.args, node.kwargs)
        )
        if isinstance(node.meta.get("val"), torch.Tensor):  # not export's dtype assertions
            counts.dtype_arguments += 1


def _cast_at_edges(ep: ExportedProgram, changed: frozenset, dtype: torch.dtype, counts: _Counts) -> None:
    """User inputs of a changed dtype cast on entry; outputs cast back to the model's dtype."""
    graph = ep.graph
    signature = ep.graph_signature
    output = graph.output_node()
    returned = list(output.args[0])
    returned_dtypes = [_tensor_dtypes(v) if isinstance(v, torch.fx.Node) else set() for v in returned]
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in signature.user_inputs]:
        if _tensor_dtypes(node) & changed:
            with graph.inserting_before(first_op):
                cast = _cast(graph, node, dtype)
            node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
            counts.edge_casts += 1
    casts: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
    for index, (spec, value, dtypes) in enumerate(zip(signature.output_specs, returned, returned_dtypes)):
        if spec.kind != OutputKind.USER_OUTPUT or not dtypes & changed:
            continue
        (original,) = dtypes
        if (value, original) not in casts:
            with graph.inserting_before(output):
                casts[value, original] = _cast(graph, value, original)
            counts.model_dtype.add(casts[value, original])
            counts.edge_casts += 1
        returned[index] = casts[value, original]
        spec.arg.name = returned[index].name
    output.args = (type(output.args[0])(returned),)


def _retrace(ep: ExportedProgram) -> None:
    """Every node's fake value computed anew from the placeholders'."""
    ep.graph_module.recompile()
    inputs = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(ep.graph_module, detect_fake_mode(inputs)).propagate_dont_convert_inputs(*inputs)


def _cast_what_remains(ep: ExportedProgram, changed: frozenset, dtype: torch.dtype, counts: _Counts) -> bool:
    """A cast after each op that still makes a changed dtype; whether any was added."""
    graph = ep.graph
    remaining = [
        n for n in graph.nodes
        if n.op == "call_function" and n not in counts.model_dtype and isinstance(n.meta.get("val"), torch.Tensor)
        and n.meta["val"].dtype in changed
    ]
    for node in remaining:
        with graph.inserting_after(node):
            cast = _cast(graph, node, dtype)
        node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
        counts.casts_added += 1
    return bool(remaining)


def compute_in(ep: ExportedProgram, choice: Choice) -> _Counts:
    """Rewrite `ep` in place to compute in `choice.dtype` (module docstring)."""
    counts = _Counts()
    changed, dtype = choice.changed, choice.dtype
    _convert_constants(ep, changed, dtype, counts)
    for module in ep.graph_module.modules():  # control-flow branches hold ops too
        if isinstance(module, torch.fx.GraphModule):
            _retarget_dtype_arguments(module.graph, changed, dtype, counts)
    _cast_at_edges(ep, changed, dtype, counts)
    _retrace(ep)
    if _cast_what_remains(ep, changed, dtype, counts):
        _retrace(ep)
    return counts


class Precision(Stage, takes=AtenProgram, returns=AtenProgram):
    metrics = (
        Metric("precision", "text", lambda why: why),
        Metric("dtype", "text", lambda dtype: f"computes in {dtype}"),
        Metric("tensors_converted", "count",
               lambda n: f"stored {counted(n, 'weight or buffer', 'weights and buffers')} in it"),
        Metric("dtype_arguments", "count",
               lambda n: f"retargeted {counted(n, 'cast or factory', 'casts and factories')}"),
        Metric("edge_casts", "count", lambda n: f"cast {counted(n, 'input or output', 'inputs and outputs')} at the edges"),
        Metric("casts_added", "count", lambda n: f"added {counted(n, 'cast')} inside"),
    )

    def apply(self, program: AtenProgram, ctx: StageContext) -> AtenProgram:
        choice = choose(ctx.options.dtype, ctx.backend)
        ep = program.program
        if choice.dtype is None and ctx.options.dtype == "auto" and not computes_in(ep, frozenset({torch.bfloat16})):
            ctx.metrics["precision"] = "as the model computes: no bfloat16 computation"
            return program
        if choice.dtype is None or not computes_in(ep, choice.changed):
            ctx.metrics["precision"] = choice.why if choice.dtype is None else "as the model computes: " + (
                f"no {', '.join(sorted(map(_name, choice.changed)))} computation"
            )
            return program
        written = written_user_inputs(ep, choice.changed)
        if written:
            why = f"the model writes its input(s) {', '.join(written)} in place, which a cast on entry would not reach"
            if ctx.options.dtype != "auto":
                raise UserInputError(
                    f"precision {ctx.options.dtype}: {why}", stage=self.name, nodes=written,
                    hint="use precision model, or give the input in the dtype the program computes in",
                )
            ctx.metrics["precision"] = f"as the model computes: {why}"
            return program
        ep = copy_program(ep)
        counts = compute_in(ep, choice)
        ctx.metrics.update(dtype=_name(choice.dtype), precision=choice.why, **counts.metrics())
        logger.info("precision: %s (%s)", choice.why, counts)
        return AtenProgram(ep)
