"""Capture: nn.Module + example inputs -> ATen program, through torch.export.

Export runs under `torch.no_grad()`: otherwise methods decorated with
`@torch.no_grad` (common in policy code) become `wrap_with_set_grad_enabled`
submodules that no backend takes.

The model's own parameters and buffers that are views into a larger storage
(`register_buffer("low", table[:8])`) get their own storage here: delegates
serialize a constant's storage from its start (XNNPACK then reads `table[0:8]`
for `high = table[8:]`: silently wrong). From capture on, every program's
constants own their bytes, an invariant each artifact type checks.

Two buffers given the same new value (`self.a.copy_(x); self.b.copy_(x)`, or
`self.b.copy_(self.a)` after `self.a.add_(x)`) break torch's own signature check
once the program is functionalized (`run_decompositions`, so also stock ExecuTorch:
"User output x is not in the correct order"): the copy's source is cloned here,
so every mutated buffer gets a value of its own.

Outputs that are `torch.return_types` (a forward returning `x.max(dim=-1)`) are
handed on as plain tuples: neither ExecuTorch's emitter nor its serializer can
name those types ("No registered serialization name"), and the program's
outputs are a flat list of tensors anyway.
"""

from __future__ import annotations

import logging

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from compiler.ir.artifacts import AtenProgram, EagerModel
from compiler.ir.errors import CaptureError
from compiler.ir.invariants import owns_its_bytes, plain_tensor
from compiler.stages.base import Stage, StageContext

logger = logging.getLogger(__name__)


def own_model_views(ep: ExportedProgram) -> list[str]:
    """Give each of the model's constants that is a view its own storage; returns their
    targets. The entries are replaced, so the user's module keeps its tensors, and the
    layout stays (a transposed parameter is all of its storage)."""
    owned = []
    for spec in ep.graph_signature.input_specs:
        store = ep.state_dict if spec.target in ep.state_dict else ep.constants
        value = store.get(spec.target)
        if not plain_tensor(value) or owns_its_bytes(value):
            continue
        copy = value.detach().clone()
        if isinstance(value, torch.nn.Parameter):
            copy = torch.nn.Parameter(copy, requires_grad=value.requires_grad)
        store[spec.target] = copy
        owned.append(spec.target)
    if owned:
        logger.info("capture: %d model constants were views; each now owns its storage", len(owned))
    return owned


def _shared_value(source: torch.fx.Node, copies: set[torch.fx.Node]) -> bool:
    """Whether functionalization may give `source` to another buffer or output too."""
    if source.op == "placeholder" or (source.op == "call_function" and source.target._schema.name.endswith("_")):
        return True
    return len([u for u in source.users if u in copies]) > 1


def distinct_mutation_sources(ep: ExportedProgram) -> int:
    """Clone the source of each copy into a buffer that may share its value; returns how many."""
    buffers = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.BUFFER}
    copies = {
        n for n in ep.graph.nodes
        if n.target is torch.ops.aten.copy_.default and getattr(n.args[0], "name", None) in buffers
    }
    cloned = 0
    for node in [n for n in ep.graph.nodes if n in copies]:
        source = node.args[1]
        if isinstance(source, torch.fx.Node) and _shared_value(source, copies):
            with ep.graph.inserting_before(node):
                clone = ep.graph.call_function(torch.ops.aten.clone.default, (source,))
            clone.meta = {k: v for k, v in source.meta.items() if k in ("val", "tensor_meta", "stack_trace")}
            node.replace_input_with(source, clone)
            cloned += 1
    if cloned:
        ep.graph_module.recompile()
    return cloned


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


class Capture(Stage):
    name = "capture"
    takes = EagerModel
    returns = AtenProgram

    def run(self, model: EagerModel, ctx: StageContext) -> AtenProgram:
        try:
            with torch.no_grad():
                program = torch.export.export(
                    model.module,
                    model.example_inputs,
                    dynamic_shapes=model.dynamic_shapes,
                    strict=False,
                )
        except Exception as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CaptureError(
                f"torch.export could not capture {type(model.module).__name__}: "
                f"{type(exc).__name__}: {first_line}",
                stage=self.name,
                hint="make forward() traceable (no data-dependent Python control flow, "
                "no unsupported Python objects); run with --traceback for the full export error",
            ) from exc
        return_types_as_tuples(program)
        if distinct_mutation_sources(program):
            ctx.metrics["mutation_sources_cloned"] = True
        owned = own_model_views(program)
        if owned:
            ctx.metrics["views_owned"] = len(owned)
        return AtenProgram(program)
