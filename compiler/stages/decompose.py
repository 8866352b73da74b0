"""Decompose: the captured program -> the Edge program, everything decomposed to Core ATen but
what the dry run planned to keep whole (the decomposition itself: `compiler.passes.decomposition`)."""

from __future__ import annotations

from compiler.ir.artifacts import EdgeProgram, PlannedProgram
from compiler.passes.decomposition import to_edge_program
from compiler.stages.base import Stage, StageContext
from compiler.reporting.report import Metric


class Decompose(Stage, takes=PlannedProgram, returns=EdgeProgram):
    metrics = (
        Metric("from_dry_run", "flag", lambda _: "the dry run's decomposition, which kept exactly these ops whole"),
        Metric("retraced", "text", lambda why: f"decomposed by torch's retrace (node by node failed: {why})"),
    )

    """Keeps whole exactly what the dry run planned; never asks the backend again. When the dry
    run already made this very decomposition (it dropped nothing), that is the output."""

    def apply(self, planned: PlannedProgram, ctx: StageContext) -> EdgeProgram:
        if planned.decomposed is not None:
            ctx.metrics["from_dry_run"] = True
            return planned.decomposed
        fallbacks: list[str] = []
        with ctx.program_checks_skipped():
            edge = to_edge_program(planned.program, planned.keep_whole.nodes, fallbacks)
        if fallbacks:
            ctx.metrics["retraced"] = fallbacks[0]
        return edge
