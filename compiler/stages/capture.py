"""Capture: nn.Module + example inputs -> ATen program, through torch.export.

Export runs under `torch.no_grad()`: otherwise methods decorated with
`@torch.no_grad` (common in policy code) become `wrap_with_set_grad_enabled`
submodules that no backend takes.

The model's own parameters and buffers that are views into a larger storage
(`register_buffer("low", table[:8])`) get their own storage here: delegates
serialize a constant's storage from its start (XNNPACK then reads `table[0:8]`
for `high = table[8:]`: silently wrong). Constants stored in another layout
(`torch.randn(1, 4, 16).transpose(0, 1)`, a channels-last weight) get row-major
strides: ExecuTorch derives a dim order from the strides and supports only a few
(a (4, 1, 16) tensor with strides (16, 64, 1) has dim order [1, 0, 2]; stock's
XNNPACK and portable programs then fail at run time with error 0x10). From capture
on, every program's constants own their bytes in row-major order, invariants each
artifact type checks; fold stores the constants it makes the same way.

A dynamic input size without an upper bound (`torch.export.Dim("seq")`, `Dim.AUTO`) is
refused by name: ExecuTorch plans each tensor's memory for its size's upper bound, and for
the example's size where there is none, so the program would refuse every longer input.

Every mutated buffer's new value is given a node of its own here. Two buffers
given the same value (`self.a.copy_(x); self.b.copy_(x)`, or `self.b.copy_(self.a)`
after `self.a.add_(x)`) break torch's own signature check once the program is
functionalized (`run_decompositions`, so also stock ExecuTorch: "User output x is
not in the correct order"); a mutated buffer that is also returned
(`self.s.add_(x); return self.s`) breaks `to_backend` ("buffer mutation node was
found to also be used as other types of outputs"; also when what is returned is
the value copied into the buffer, or the buffer through an op that may return its
input itself, such as `to` its own dtype, which functionalization removes). The copy's
source, or the returned value, is cloned.

Indexing by a 0-d integer tensor (`x[:, idx]`, `idx` computed) is exported as
`select(x, dim, idx.item())`: a size-free index read at run time, which ExecuTorch's
Edge passes cannot retrace ("Could not guard on data-dependent expression 5 <=
-u6 - 1"; stock fails the same way). It becomes `index_select` by the index
(wrapped like torch wraps a negative one), squeezed: no value is read at run time.

A tensor the model keeps outside its registered buffers (a plain attribute, or one held
by a helper object such as transformers' `StaticCache`, even when the same tensor is
also registered as a buffer elsewhere) is lifted by `torch.export` as a constant; when
forward writes it in place, functionalization refuses the program ("Constant
lifted_tensor_0 is mutated in the forward method. Pls register it as buffer"; stock
fails the same way). Every constant the graph writes becomes a non-persistent buffer
here, so its writes become buffer mutations like any other state.

A mask built with `torch.vmap` (transformers' masking utilities do so when a model adds
its own mask function, as Gemma 3 does for image tokens) is exported as a region between
functorch's nesting markers whose values are batched tensors. Nothing after capture can
hold one: folding it, or a backend's support check reading its fake value, fails with
"your tensor may have escaped from inside a function being vmapped". When the graph has
such a region, capture retraces the program once with no decompositions, which applies
vmap's batching rules and leaves plain ATen ops. That retrace also turns every `reshape`
into a `view` where the traced strides allow one, and those are a kernel's strides (SDPA
on the CPU keeps its inputs' heads-last layout); a later decomposition of that kernel
lays its output out another way ("Cannot view a tensor with shape [1, 16, 4, 16] and
strides ..."), so the views it made become reshapes again (the same where a view is
valid, a program without mutations has no alias to keep).

When export cannot trace the model, the error names the line where tracing stopped:
torch's own message leads with a guard expression (`Eq(u0, 1)`) or a bytecode jump, and
for a library's code (a diffusion scheduler's `prev_timestep >= 0` on a tensor
timestep) the line is deep in a traceback of torch's frames.

Outputs that are `torch.return_types` (a forward returning `x.max(dim=-1)`) are
handed on as plain tuples: neither ExecuTorch's emitter nor its serializer can
name those types ("No registered serialization name"), and the program's
outputs are a flat list of tensors anyway.
"""

from __future__ import annotations

import logging
import os
import sysconfig
import traceback
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from compiler.ir import dynamic
from compiler.ir.artifacts import AtenProgram, EagerModel
from compiler.ir.errors import CaptureError, UserInputError
from compiler.ir.graph import TRANSFORM_MARKERS, rename_output, writes_argument
from compiler.ir.invariants import owns_its_bytes, plain_tensor, row_major
from compiler.passes.complex_pairs import complex_as_real_pairs
from compiler.passes.resizes import antialiased_resizes_as_matmuls
from compiler.stages.base import Stage, StageContext
from compiler.reporting.report import Metric, counted

logger = logging.getLogger(__name__)


def own_model_constants(ep: ExportedProgram) -> tuple[list[str], list[str]]:
    """Give each of the model's constants that is a view its own storage, and each stored in
    another layout row-major strides; returns the targets of both. The entries are replaced,
    so the user's module keeps its tensors."""
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    views, restrided = [], []
    for spec in ep.graph_signature.input_specs:
        store = ep.state_dict if spec.target in ep.state_dict else ep.constants
        value = store.get(spec.target)
        if not plain_tensor(value) or (owns_its_bytes(value) and row_major(value)):
            continue
        (views if not owns_its_bytes(value) else restrided).append(spec.target)
        copy = value.detach().clone(memory_format=torch.contiguous_format)
        if isinstance(value, torch.nn.Parameter):
            copy = torch.nn.Parameter(copy, requires_grad=value.requires_grad)
        store[spec.target] = copy
        node = placeholders[spec.arg.name]
        fake = node.meta["val"]
        with torch._guards.detect_fake_mode([fake]):
            node.meta["val"] = fake.clone(memory_format=torch.contiguous_format)
    if views or restrided:
        logger.info("capture: model constants given their own row-major storage: %s", views + restrided)
    return views, restrided


def _same_tensor_key(value: torch.Tensor) -> tuple:
    return (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)


def mutated_constants_as_buffers(ep: ExportedProgram) -> list[str]:
    """Turn every lifted constant the graph writes into a non-persistent buffer; returns their targets.

    A constant that is the very tensor of a buffer (registered under another name, or another
    written constant) is read through that buffer instead: two placeholders for one written
    tensor are aliased inputs, which functionalization cannot export; and a state one method of
    a program writes, another may only read (through a cache object rather than the module's
    buffer): as a constant it would be its value at capture in that method.
    """
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    buffers: dict[tuple, torch.fx.Node] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.BUFFER:
            value = (ep.state_dict if spec.persistent else ep.constants)[spec.target]
            buffers.setdefault(_same_tensor_key(value), placeholders[spec.arg.name])
    written, merged = [], []
    for spec in list(ep.graph_signature.input_specs):
        node = placeholders[spec.arg.name]
        if spec.kind != InputKind.CONSTANT_TENSOR:
            continue
        key = _same_tensor_key(ep.constants[spec.target])
        writes = any(writes_argument(u, node) for u in node.users)
        if key in buffers:
            node.replace_all_uses_with(buffers[key])
            ep.graph.erase_node(node)
            ep.graph_signature.input_specs.remove(spec)
            del ep.constants[spec.target]
            merged.append(spec.target)
        elif writes:
            spec.kind, spec.persistent = InputKind.BUFFER, False
            buffers[key] = node
        if writes:
            written.append(spec.target)
    if written or merged:
        ep.graph_module.recompile()
        logger.info("capture: constants written in forward became buffers: %s (read as a buffer: %s)", written, merged)
    return written


def has_transform_regions(ep: ExportedProgram) -> bool:
    return any(n.op == "call_function" and n.target in TRANSFORM_MARKERS for n in ep.graph.nodes)


def has_autocast_regions(ep: ExportedProgram) -> bool:
    return any(n.op == "call_function" and n.target is torch.ops.higher_order.wrap_with_autocast for n in ep.graph.nodes)


def inline_regions(ep: ExportedProgram) -> ExportedProgram:
    """Retrace `ep` with no decompositions (vmap's batching rules run, an autocast region's casts
    become explicit); views become reshapes."""
    with torch.no_grad():
        retraced = ep.run_decompositions({})
    for node in retraced.graph.nodes:
        if node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    retraced.graph_module.recompile()
    return retraced


def batch_norm_writes_declared(ep: ExportedProgram) -> int:
    """`native_batch_norm` in training with running statistics as `_native_batch_norm_legit`, the
    same kernel whose schema declares that it writes them. Undeclared, functionalization gives the
    writes outputs the signature does not list: their new values took the places of the first two
    outputs (stock gives the same). Returns how many were rewritten."""
    rewritten = 0
    for node in ep.graph.nodes:
        if node.target is not torch.ops.aten.native_batch_norm.default:
            continue
        running_mean, running_var, training = node.args[3:6]
        if training and isinstance(running_mean, torch.fx.Node) and isinstance(running_var, torch.fx.Node):
            node.target = torch.ops.aten._native_batch_norm_legit.default
            rewritten += 1
    if rewritten:
        ep.graph_module.recompile()
    return rewritten


def _shared_value(source: torch.fx.Node, copies: set[torch.fx.Node]) -> bool:
    """Whether functionalization may give `source` to another buffer or output too."""
    if source.op == "placeholder" or (
        isinstance(source.target, torch._ops.OpOverload) and source.target._schema.name.endswith("_")
    ):
        return True
    return len([u for u in source.users if u in copies]) > 1


def _writes_buffer(node: torch.fx.Node, buffers: set[str]) -> bool:
    """An in-place op on a buffer, whose result is the buffer's new value."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target._schema.name.endswith("_")
        and getattr(node.args[0] if node.args else None, "name", None) in buffers
    )


def _clone_input(ep: ExportedProgram, node: torch.fx.Node, source: torch.fx.Node) -> None:
    with node.graph.inserting_before(node):
        clone = node.graph.call_function(torch.ops.aten.clone.default, (source,))
    clone.meta = {k: v for k, v in source.meta.items() if k in ("val", "tensor_meta", "stack_trace")}
    node.replace_input_with(source, clone)
    if node.op == "output":
        rename_output(ep, source.name, clone.name)


def _may_return_its_input(node: torch.fx.Node) -> bool:
    """An op whose result may be its first argument itself (`to` its own dtype, `contiguous`
    of a contiguous tensor, `view_as` of itself): functionalized, it leaves that node."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    returns = node.target._schema.returns
    alias = returns[0].alias_info if len(returns) == 1 else None
    return alias is not None and not alias.is_write and bool(node.args) and isinstance(node.args[0], torch.fx.Node)


def _returned_as_is(value: torch.fx.Node) -> torch.fx.Node:
    """The node `value` may be, through ops that may return their input itself."""
    while _may_return_its_input(value):
        value = value.args[0]
    return value


def distinct_mutated_values(ep: ExportedProgram) -> int:
    """Clone each copy source or returned value a mutated buffer would share; returns how many."""
    buffers = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.BUFFER}
    copies = {n for n in ep.graph.nodes if n.target is torch.ops.aten.copy_.default and _writes_buffer(n, buffers)}
    shared = [(n, n.args[1]) for n in ep.graph.nodes if n in copies and isinstance(n.args[1], torch.fx.Node)]
    shared = [(n, source) for n, source in shared if _shared_value(source, copies)]
    output = ep.graph.output_node()
    # A returned buffer, in-place result or copy source would be a buffer's new value too.
    new_values = {n.args[0] for n in ep.graph.nodes if _writes_buffer(n, buffers)} | {n.args[1] for n in copies}
    shared += [
        (output, v)
        for v in dict.fromkeys(output.all_input_nodes)
        if _writes_buffer(_returned_as_is(v), buffers) or _returned_as_is(v) in new_values
    ]
    for node, source in shared:
        _clone_input(ep, node, source)
    if shared:
        ep.graph_module.recompile()
    return len(shared)


_ITEM = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)


def select_by_tensor(ep: ExportedProgram) -> int:
    """Rewrite `select(x, dim, t.item())` as `index_select(x, dim, t % size).squeeze(dim)`."""
    graph = ep.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.select.int or not isinstance(node.args[2], torch.fx.Node):
            continue
        item = node.args[2]
        source, value = item.args[0] if item.target in _ITEM else None, node.args[0].meta.get("val")
        if source is None or not isinstance(value, torch.Tensor):
            continue
        dim = node.args[1] % value.dim()
        mode = torch._guards.detect_fake_mode([value])
        with graph.inserting_before(node), mode:
            wrapped = graph.call_function(torch.ops.aten.remainder.Scalar, (source, value.shape[dim]))
            wrapped.meta["val"] = torch.ops.aten.remainder.Scalar(source.meta["val"], value.shape[dim])
            flat = graph.call_function(torch.ops.aten.reshape.default, (wrapped, [1]))
            flat.meta["val"] = wrapped.meta["val"].reshape([1])
            picked = graph.call_function(torch.ops.aten.index_select.default, (node.args[0], dim, flat))
            picked.meta["val"] = torch.ops.aten.index_select.default(value, dim, flat.meta["val"])
            squeezed = graph.call_function(torch.ops.aten.squeeze.dims, (picked, [dim]))
            squeezed.meta["val"] = picked.meta["val"].squeeze(dim)
        for new in (wrapped, flat, picked, squeezed):
            new.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(squeezed)
        rename_output(ep, node.name, squeezed.name)
        graph.erase_node(node)
        if not item.users:
            graph.erase_node(item)
        rewritten += 1
    if rewritten:
        ep.graph_module.recompile()
    return rewritten


def _structseqs_as_tuples(spec: pytree.TreeSpec) -> pytree.TreeSpec:
    if spec.is_leaf():
        return spec
    children = [_structseqs_as_tuples(child) for child in spec.children()]
    if pytree.is_structseq_class(spec.type):
        return pytree.TreeSpec(tuple, None, children)
    return pytree.TreeSpec(spec.type, spec.context, children)


def return_types_as_tuples(ep: ExportedProgram) -> None:
    signature = ep.module_call_graph[0].signature
    if signature is not None and signature.out_spec is not None:
        signature.out_spec = _structseqs_as_tuples(signature.out_spec)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _describe_inputs(inputs: tuple) -> str:
    def one(leaf: Any) -> str:
        if isinstance(leaf, torch.Tensor):
            return f"Tensor{list(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}"
        return type(leaf).__name__

    return "(" + ", ".join(one(leaf) for leaf in pytree.tree_leaves(inputs)) + ")"


# Frames in these folders are the tracer's (torch, this package) or Python's own.
_TORCH_AND_OURS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)
_STANDARD_LIBRARY = sysconfig.get_paths()["stdlib"] + os.sep


def _tracers_frame(filename: str) -> bool:
    standard = filename.startswith(_STANDARD_LIBRARY) and "site-packages" not in filename
    return standard or filename.startswith(_TORCH_AND_OURS) or filename.startswith("<")


def traced_code_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    """The frames of the user's or a library's code that torch.export was tracing when it
    stopped, outermost first: the model's `forward`, down to the line that could not be traced.

    Non-strict export runs that code for real, so its frames are in the traceback; strict
    export (TorchDynamo) interprets it and keeps them as `real_stack`.
    """
    frames = getattr(exc, "real_stack", None) or traceback.extract_tb(exc.__traceback__)
    return [frame for frame in frames if not _tracers_frame(frame.filename)]


def _data_dependent(exc: BaseException) -> bool:
    return isinstance(exc, GuardOnDataDependentSymNode) or "data-dependent" in str(exc).lower()


_DATA_DEPENDENT_WAYS_OUT = (
    "branch on a tensor's value with torch.cond (both sides are traced); pass values that are fixed "
    "for the exported program (a scheduler's timestep, a count) as Python numbers, not tensors; or, "
    "where the code only checks a fact export cannot know (a size, a sign), state it with torch._check(...)"
)


def _where(frame: traceback.FrameSummary) -> str:
    code = f": {frame.line.strip()}" if frame.line else ""
    return f"{frame.filename}:{frame.lineno} in {frame.name}{code}"


def _capture_error(model: EagerModel, exc: Exception) -> CaptureError:
    """Tells inputs that the model cannot take (eager fails too) from code export cannot
    trace (eager runs): the two need different fixes. The second names the line where
    tracing stopped, which torch's own message buries under its guard expression."""
    name = type(model.module).__name__
    try:
        with torch.no_grad():
            model.module(*model.example_inputs)
    except Exception as eager_exc:
        return CaptureError(
            f"{name} fails in eager PyTorch on the example inputs {_describe_inputs(model.example_inputs)}: "
            f"{_first_line(eager_exc)}",
            stage="capture",
            hint="give example inputs of the shapes, dtypes and number forward() expects "
            "(the chained exception is torch.export's error)",
        )
    frames = traced_code_frames(exc)
    where = ""
    if frames:
        where = f"; tracing stopped at {_where(frames[-1])}"
        if len(frames) > 1:
            where += f" (reached from {_where(frames[0])})"
    if _data_dependent(exc):
        return CaptureError(
            f"torch.export could not capture {name}: Python control flow depends on a tensor's value{where} "
            f"({_first_line(exc)})",
            stage="capture",
            hint=f"{_DATA_DEPENDENT_WAYS_OUT}; the chained exception is the full export error",
        )
    return CaptureError(
        f"torch.export could not capture {name}: {_first_line(exc)}{where}",
        stage="capture",
        hint="make forward() traceable (no data-dependent Python control flow, "
        "no unsupported Python objects); the chained exception is the full export error",
    )


def _refuse_unbounded_sizes(program) -> None:
    unbounded = dynamic.unbounded_sizes(program)
    if unbounded:
        raise UserInputError(
            f"the dynamic size {', '.join(unbounded)} has no upper bound: ExecuTorch plans each tensor's memory "
            "for its largest size, and without a bound for the example's, so the program would refuse any "
            "longer input",
            stage="capture",
            hint="give each dynamic dimension a maximum in dynamic_shapes, e.g. torch.export.Dim('seq', min=2, max=512)",
        )


class Capture(Stage, takes=EagerModel, returns=AtenProgram):
    metrics = (
        Metric("constants_made_buffers", "count", lambda n: f"made {counted(n, 'constant')} the model writes to into buffers"),
        Metric("selects_by_tensor", "count", lambda n: f"rewrote {counted(n, 'select')} by a tensor value as index_select"),
        Metric("mutation_sources_cloned", "count", lambda n: f"cloned {counted(n, 'value')} a mutated buffer would share"),
        Metric("vmap_inlined", "flag", lambda _: "inlined vmap regions"),
        Metric("autocast_inlined", "flag", lambda _: "inlined autocast regions with their casts"),
        Metric("batch_norm_writes_declared", "count",
               lambda n: f"declared the running-statistics writes of {counted(n, 'training batch norm')}"),
        Metric("views_owned", "count", lambda n: f"gave {counted(n, 'constant view')} its own storage"),
        Metric("constants_made_row_major", "count", lambda n: f"made {counted(n, 'constant')} row-major"),
        Metric("complex_as_pairs", "count",
               lambda n: f"computed {counted(n, 'complex value')} as real pairs (real, imaginary)"),
        Metric("antialiased_resizes", "count",
               lambda n: f"wrote {counted(n, 'antialiased resize')} as matrix products with torch's weights"),
    )

    def apply(self, model: EagerModel, ctx: StageContext) -> AtenProgram:
        try:
            with torch.no_grad():
                program = torch.export.export(
                    model.module,
                    model.example_inputs,
                    dynamic_shapes=model.dynamic_shapes,
                    strict=ctx.options.strict,
                )
        except Exception as exc:
            raise _capture_error(model, exc) from exc
        _refuse_unbounded_sizes(program)
        return_types_as_tuples(program)
        count = len(mutated_constants_as_buffers(program))  # before any retrace: torch refuses a written constant
        if count:
            ctx.metrics["constants_made_buffers"] = count
        count = batch_norm_writes_declared(program)
        if count:
            ctx.metrics["batch_norm_writes_declared"] = count
        if has_autocast_regions(program):  # before the rewrites, which do not look inside a region
            program = inline_regions(program)
            ctx.metrics["autocast_inlined"] = True
        rewrites = (  # in this order, each in place; the metric counts what it rewrote
            ("complex_as_pairs", complex_as_real_pairs),
            ("antialiased_resizes", antialiased_resizes_as_matmuls),
            ("selects_by_tensor", select_by_tensor),
            ("mutation_sources_cloned", distinct_mutated_values),
        )
        for metric, rewrite in rewrites:
            count = rewrite(program)
            if count:
                ctx.metrics[metric] = count
        if has_transform_regions(program):
            program = inline_regions(program)
            ctx.metrics["vmap_inlined"] = True
        views, restrided = own_model_constants(program)
        if views:
            ctx.metrics["views_owned"] = len(views)
        if restrided:
            ctx.metrics["constants_made_row_major"] = len(restrided)
        return AtenProgram(program)
