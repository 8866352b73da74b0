"""Partition: the Edge program -> the program tagged with the backend's partitions (the search
and its repairs: `compiler.passes.partitioning`)."""

from __future__ import annotations

from compiler.ir.artifacts import EdgeProgram, PartitionedProgram
from compiler.passes.partitioning import keep_program_state, partition
from compiler.stages.base import Stage, StageContext
from compiler.reporting.report import Metric


class Partition(Stage, takes=EdgeProgram, returns=PartitionedProgram):
    metrics = (
        Metric("search_from_dry_run", "flag", lambda _: "the dry run's partition search of this very program"),
        Metric("program_state", "text",
               lambda names: f"kept state other methods write the program's (not a delegate's constant): {names}"),
        Metric.plain("split", "text"),
    )

    def apply(self, edge: EdgeProgram, ctx: StageContext) -> PartitionedProgram:
        if edge.searched is not None:
            ctx.metrics["search_from_dry_run"] = True
            partitioned = edge.searched
        else:
            partitioned = partition(edge, ctx.backend, ctx.program_state)
        if partitioned.split_notes:
            ctx.metrics["split"] = "; ".join(partitioned.split_notes)
        partitioned, kept = keep_program_state(partitioned, ctx.program_state)
        if kept:
            ctx.metrics["program_state"] = ", ".join(kept)
        return partitioned
