"""ATen program -> Edge program, with ExecuTorch's own passes, skipping those that cannot apply.

It also finishes what those passes leave half done: ATen ops inserted after the
ATen-to-Edge replacement become Edge ops.

ExecuTorch's ATen-to-Edge conversion runs about a dozen passes, most of them
`ExportPass`es that retrace the whole graph with fake tensors even when they
change nothing: on a 48-block transformer each retrace costs about half a
second. The passes and their order are ExecuTorch's; what this module adds is a
cheap, conservative check per pass of whether the graph holds anything the
pass rewrites. A pass without such a check always runs.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch
from torch.export import ExportedProgram

from executorch.exir import EdgeCompileConfig
from executorch.exir.passes import MemoryFormatOpsPass, OpReplacePass, remove_unused_parameters_pass
from executorch.exir.passes.normalize_transpose_pass import NormalizeTransposePass
from executorch.exir.passes.remove_graph_asserts_pass import RemoveNonCoreAtenOpGraphAssertsPass
from executorch.exir.passes.remove_mixed_type_operators import RemoveMixedTypeOperators
from executorch.exir.passes.replace_aten_with_edge_pass import aten_to_edge
from executorch.exir.passes.replace_broken_ops_with_function_ops_pass import (
    ReplaceBrokenOpsWithFunctionalOpsPass,
)
from executorch.exir.passes.sym_to_tensor_pass import SymToTensorPass
from executorch.exir.passes.convert_constant_dim_order_pass import convert_constant_dim_order_pass
from executorch.exir.verification.verifier import EXIREdgeDialectVerifier
from torch._export.passes import ReplaceViewOpsWithViewCopyOpsPass

from compiler.ir.dialect import ATEN, op_dialect
from compiler.private_api import (
    aten_to_edge_passes,
    lift_constant_tensor_pass,
    transform,
    unwrap_pass,
    updated_graph_signature,
)

logger = logging.getLogger(__name__)

aten = torch.ops.aten

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)

# The ops RemoveMixedTypeOperators promotes (it rewrites nothing else).
_PROMOTING_OPS = frozenset(
    [aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.div.Tensor_mode, aten.minimum.default]
)


def _calls(gm: torch.fx.GraphModule) -> Iterable[torch.fx.Node]:
    return (n for n in gm.graph.nodes if n.op == "call_function")


def _has_transpose(gm: torch.fx.GraphModule) -> bool:
    return any(n.target is aten.t.default for n in _calls(gm))


def _has_view_op(gm: torch.fx.GraphModule) -> bool:
    return any(isinstance(n.target, torch._ops.OpOverload) and n.target.is_view for n in _calls(gm))


def _has_symbolic_argument(gm: torch.fx.GraphModule) -> bool:
    return any(
        isinstance(a.meta.get("val"), _SYMBOLIC)
        for n in _calls(gm)
        if isinstance(n.target, torch._ops.OpOverload)
        for a in n.all_input_nodes
    )


def _has_mixed_types(gm: torch.fx.GraphModule) -> bool:
    """A promoting op whose output dtype differs from one of its inputs' (a cast is needed)."""
    for node in _calls(gm):
        if node.target not in _PROMOTING_OPS:
            continue
        out = node.meta.get("val")
        if not isinstance(out, torch.Tensor):
            return True  # cannot tell: let the pass decide
        for arg in node.args:
            value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg
            if isinstance(value, torch.Tensor) and value.dtype != out.dtype:
                return True
            if isinstance(value, _SYMBOLIC):
                return True
            if isinstance(value, (bool, int, float)) and not out.dtype.is_floating_point:
                return True  # a Python number next to an integer or bool tensor
    return False


# Pass type -> "does the graph hold anything this pass rewrites?"
_APPLIES: dict[type, Callable[[torch.fx.GraphModule], bool]] = {
    NormalizeTransposePass: _has_transpose,
    ReplaceBrokenOpsWithFunctionalOpsPass: _has_view_op,
    SymToTensorPass: _has_symbolic_argument,
    RemoveMixedTypeOperators: _has_mixed_types,
}


def _applies(graph_pass, gm: torch.fx.GraphModule) -> bool:
    check = _APPLIES.get(type(unwrap_pass(graph_pass)))
    return check is None or check(gm)


def _is_dead_code_pass(graph_pass) -> bool:
    return getattr(unwrap_pass(graph_pass), "__name__", "") == "dead_code_elimination_pass"


def _eliminate_dead_code(gm: torch.fx.GraphModule):
    """Stock's dead-code pass recompiles every module even when nothing was removed."""
    changed = False
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule) and module.graph.eliminate_dead_code():
            module.recompile()
            changed = True
    return changed


def generate_edge_program(
    program: ExportedProgram, preserve_ops: list[torch._ops.OpOverload]
) -> tuple[ExportedProgram, list[str]]:
    """The Edge program for a decomposed ATen program; also the names of the passes skipped."""
    config = EdgeCompileConfig()
    program = remove_unused_parameters_pass(program)
    pre_replace, post_replace = aten_to_edge_passes(config)
    passes = [
        RemoveNonCoreAtenOpGraphAssertsPass(),
        ReplaceViewOpsWithViewCopyOpsPass(),
        *pre_replace,
        OpReplacePass(),
        MemoryFormatOpsPass(),
    ]
    gm, skipped = program.graph_module, []
    for graph_pass in passes:
        if not _applies(graph_pass, gm):
            skipped.append(type(unwrap_pass(graph_pass)).__name__)
            continue
        gm = graph_pass(gm).graph_module
    edge = ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=updated_graph_signature(program.graph_signature, gm),
        state_dict=program.state_dict,
        range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph,
        example_inputs=program.example_inputs,
        constants=program.constants,
        verifiers=[EXIREdgeDialectVerifier(edge_compile_config=config, class_only=True, preserve_ops=preserve_ops)],
    )
    edge = lift_constant_tensor_pass(edge)
    edge = convert_constant_dim_order_pass(edge)
    for graph_pass in post_replace:
        if _is_dead_code_pass(graph_pass):
            _eliminate_dead_code(edge.graph_module)
            continue
        edge = transform(edge, graph_pass)
    _finish_edge_ops(edge)
    logger.debug("Edge conversion skipped passes that could not apply: %s", skipped)
    return edge, skipped


def _finish_edge_ops(program: ExportedProgram) -> None:
    """Turn ATen ops that ExecuTorch's passes left behind into Edge ops.

    Stock 1.5.1's Edge passes insert `aten.scalar_tensor` (e.g. for the `masked_fill`
    inside `nn.MultiheadAttention` with a bool mask) after the ATen-to-Edge replacement
    has run, leaving an ATen op in the Edge program.
    """
    leftovers = [n for n in program.graph.nodes if n.op == "call_function" and op_dialect(n.target) == ATEN]
    for node in leftovers:
        node.target = aten_to_edge(node.target)
    if leftovers:
        program.graph_module.recompile()
