"""Decompose: ATen program -> Edge program, keeping whole the nodes the dry run planned.

One `run_decompositions` call: the nodes the dry run planned to keep whole are
renamed into ExecuTorch's no-decompose namespace for that one call and named
back afterwards, instead of stock's decompose / rename / decompose-again.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from executorch.exir.program._program import (
    _register_no_decomp_op,
    _restore_transformed_ops_to_aten_ops,
    aten_op_to_transform_op,
)
from executorch.exir.tracer import _default_decomposition_table

from compiler.ir.artifacts import EdgeProgram, PlannedProgram
from compiler.ir.dialect import op_name
from compiler.ir.graph import call_nodes
from compiler.stages.base import Stage, StageContext
from compiler.stages.edge_conversion import generate_edge_program


def decompose(
    program: ExportedProgram, keep_nodes: frozenset[str] | set[str]
) -> tuple[ExportedProgram, list[torch._ops.OpOverload]]:
    """Decompose to core ATen except the nodes named; returns the program and the ops kept.

    The names come from the dry run, which already dropped ops that cannot be kept
    whole (mutating or aliasing ones)."""
    renamed: list[tuple[torch.fx.Node, torch._ops.OpOverload]] = []
    for node in call_nodes(program):
        if node.name in keep_nodes:
            _register_no_decomp_op(node.target)
            renamed.append((node, node.target))
            node.target = aten_op_to_transform_op[node.target]
    try:
        decomposed = program.run_decompositions(_default_decomposition_table())
    finally:
        for node, target in renamed:  # the input artifact must come back unchanged
            node.target = target
    _restore_transformed_ops_to_aten_ops(decomposed)
    return decomposed, sorted({target for _, target in renamed}, key=str)


def to_edge_program(program: ExportedProgram, keep_nodes: frozenset[str] | set[str]) -> EdgeProgram:
    """The Edge program for `program`, keeping whole the nodes named (the dry run uses this too)."""
    decomposed, preserved = decompose(program, keep_nodes)
    edge, _ = generate_edge_program(decomposed, preserved)
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
