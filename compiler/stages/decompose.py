"""Decompose: ATen program -> Edge program, keeping whole the ops the backend asks for.

One `run_decompositions` call. When the backend narrows its request to some
nodes (a node filter, like ExecuTorch's `check_op_support`), those nodes are
renamed into ExecuTorch's no-decompose namespace for that one call and named
back afterwards, instead of stock's decompose / rename / decompose-again.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from executorch.exir.program._program import (
    _register_no_decomp_op,
    _remove_invalid_ops_for_not_decompose,
    _restore_transformed_ops_to_aten_ops,
    aten_op_to_transform_op,
)
from executorch.exir.passes.replace_aten_with_edge_pass import aten_to_edge
from executorch.exir.tracer import _default_decomposition_table

from compiler.backends.base import KeepWhole
from compiler.ir.artifacts import EdgeProgram, PlannedProgram
from compiler.ir.dialect import ATEN, op_dialect, op_name
from compiler.ir.graph import call_nodes
from compiler.stages.base import Stage, StageContext
from compiler.stages.edge_conversion import generate_edge_program


def decompose(
    program: ExportedProgram, keep: KeepWhole
) -> tuple[ExportedProgram, list[torch._ops.OpOverload]]:
    """Decompose to core ATen except `keep`; returns the program and the ops really kept."""
    table = _default_decomposition_table()
    if keep.node_filter is None:
        preserved = [op for op in keep.ops if table.pop(op, None) is not None]
        return program.run_decompositions(table), preserved

    candidates = set(_remove_invalid_ops_for_not_decompose(list(keep.ops)))
    renamed: list[tuple[torch.fx.Node, torch._ops.OpOverload]] = []
    for node in call_nodes(program):
        if node.target in candidates and keep.node_filter(node):
            _register_no_decomp_op(node.target)
            renamed.append((node, node.target))
            node.target = aten_op_to_transform_op[node.target]
    try:
        decomposed = program.run_decompositions(table)
    finally:
        for node, target in renamed:  # the input artifact must come back unchanged
            node.target = target
    _restore_transformed_ops_to_aten_ops(decomposed)
    return decomposed, sorted({target for _, target in renamed}, key=str)


def finish_edge_ops(program: ExportedProgram) -> int:
    """Turn ATen ops that ExecuTorch's post-conversion passes left behind into Edge ops.

    Stock 1.5.1's Edge passes insert `aten.scalar_tensor` (e.g. for the
    `masked_fill` inside `nn.MultiheadAttention` with a bool mask) after the
    ATen-to-Edge replacement has run, leaving an ATen op in the Edge program.
    """
    fixed = 0
    for node in call_nodes(program):
        if op_dialect(node.target) == ATEN:
            node.target = aten_to_edge(node.target)
            fixed += 1
    if fixed:
        program.graph_module.recompile()
    return fixed


def to_edge_program(program: ExportedProgram, keep_nodes: frozenset[str] | set[str]) -> EdgeProgram:
    """The Edge program for `program`, keeping whole the nodes named (the dry run uses this too)."""
    ops = frozenset(n.target for n in call_nodes(program) if n.name in keep_nodes)
    decomposed, preserved = decompose(program, KeepWhole(ops, lambda node: node.name in keep_nodes))
    edge, _ = generate_edge_program(decomposed, preserved)
    finish_edge_ops(edge)
    return EdgeProgram(edge, tuple(op_name(op) for op in preserved))


class Decompose(Stage):
    """Keeps whole exactly what the dry run planned; never asks the backend again."""

    name = "decompose"
    takes = PlannedProgram
    returns = EdgeProgram

    def run(self, planned: PlannedProgram, ctx: StageContext) -> EdgeProgram:
        if planned.decomposed is not None:
            ctx.metrics["reused"] = "dry run"
            return planned.decomposed
        return to_edge_program(planned.program, planned.keep_whole.nodes)
