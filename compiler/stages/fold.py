"""Fold: constant folding on the ATen program.

A pass-through for now; the dialect-aware folding described in DESIGN.md
replaces it. It is a stage already so dumps, resume names and reports keep
their shape when it gains behaviour.
"""

from __future__ import annotations

from compiler.ir.artifacts import AtenProgram
from compiler.stages.base import Stage, StageContext


class Fold(Stage):
    name = "fold"
    takes = AtenProgram
    returns = AtenProgram

    def run(self, program: AtenProgram, ctx: StageContext) -> AtenProgram:
        return program
