"""Partition: Edge program -> the same program with delegation tags, and a placement plan.

The backend's partition search tags a copy of the graph (the Edge artifact
stays as it was); every node it leaves untagged gets the backend's reason.
"""

from __future__ import annotations

from compiler.backends.base import Backend
from compiler.ir.artifacts import EdgeProgram, PartitionedProgram
from compiler.ir.errors import CompileError
from compiler.ir.graph import DELEGATION_TAG, copy_program, op_nodes
from compiler.ir.placement import PlacementPlan
from compiler.stages.base import Stage, StageContext


def partition(edge: EdgeProgram, backend: Backend) -> PartitionedProgram:
    """The backend's partition search on a copy of `edge` (the dry run uses this too)."""
    program = copy_program(edge.program)
    result = backend.partition(program)
    unknown = sorted(
        {n.meta[DELEGATION_TAG] for n in program.graph.nodes if n.meta.get(DELEGATION_TAG)}
        - set(result.partitions)
    )
    if unknown:
        raise CompileError(
            f"the {backend.name} backend tagged nodes with tags it gave no backend for: {unknown}",
            hint="the backend's partition() must return a DelegationSpec for every tag it uses",
        )
    reasons = {
        n.name: result.cpu_reasons.get(n.name) or backend.default_cpu_reason(n)
        for n in op_nodes(program)
        if not n.meta.get(DELEGATION_TAG)
    }
    plan = PlacementPlan.from_tagged_program(program, result.partitions, reasons)
    refused = frozenset(str(d).removeprefix("torch.") for d in backend.refused_input_dtypes)
    return PartitionedProgram(program, plan, edge.preserved_ops, refused)


class Partition(Stage):
    """Reuses the dry run's search when the dry run partitioned this very program."""

    name = "partition"
    takes = EdgeProgram
    returns = PartitionedProgram

    def run(self, edge: EdgeProgram, ctx: StageContext) -> PartitionedProgram:
        if edge.partitioned is not None:
            ctx.metrics["reused"] = "dry run"
            return edge.partitioned
        return partition(edge, ctx.backend)
