"""Fold: constant folding that respects the program's dialect (the folding itself, and why each
rule, is `compiler.passes.folding`)."""

from __future__ import annotations

from compiler.ir.artifacts import AtenProgram
from compiler.ir.dialect import ATEN
from compiler.ir.graph import copy_program
from compiler.passes.folding import default_skip_ops, fold_constants, needs_folding, resolve_op
from compiler.stages.base import Stage, StageContext
from compiler.stages.options import FoldOptions
from compiler.reporting.report import Metric, counted, kib


class Fold(Stage, takes=AtenProgram, returns=AtenProgram):
    metrics = (
        Metric("folded", "count", lambda n: f"folded {counted(n, 'node')} into constants" if n else "folded nothing"),
        Metric("constants", "count", lambda n: f"made {counted(n, 'constant')}"),
        Metric("bytes_added", "bytes", lambda n: f"added {kib(n)} of constants"),
        Metric("bytes_removed", "bytes", lambda n: f"removed {kib(n)} of constants"),
        Metric("masks", "count", lambda n: f"turned {counted(n, 'constant bool mask')} into index positions"),
    )

    def check_options(self, options: FoldOptions) -> None:
        for op in options.skip_ops:
            resolve_op(op)

    def apply(self, program: AtenProgram, ctx: StageContext) -> AtenProgram:
        given = frozenset(resolve_op(op) for op in ctx.options.skip_ops)
        skip = given if ctx.options.replace_skip_ops else default_skip_ops(ATEN) | given
        folding = needs_folding(program.program, skip, state=ctx.program_state)
        if not folding:
            ctx.metrics["folded"] = 0
            return program
        ep = copy_program(program.program)
        result = fold_constants(ep, ATEN, skip, state=ctx.program_state)
        ctx.metrics.update(
            folded=result.nodes_folded,
            constants=result.constants_created,
            bytes_added=result.bytes_added,
            bytes_removed=result.bytes_removed,
        )
        if result.masks_to_positions:
            ctx.metrics["masks"] = result.masks_to_positions
        return AtenProgram(ep)
