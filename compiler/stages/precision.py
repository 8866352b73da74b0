"""Precision: the captured program computing in the floating dtype the backend runs fast.

A bfloat16 model on a backend without bfloat16 kernels (XNNPACK; Core ML, which converts
float32 programs and computes inside in its own compute precision) would run every op on
the portable CPU kernels. With precision `auto` such a program computes in float32, with
casts only at its edges: its bfloat16 inputs cast on entry, its outputs cast back, so it
takes and returns what the model does.
"""

from __future__ import annotations

import logging

from compiler.ir.artifacts import AtenProgram
from compiler.stages.base import Stage, StageContext

logger = logging.getLogger(__name__)


class Precision(Stage, takes=AtenProgram, returns=AtenProgram):
    def apply(self, program: AtenProgram, ctx: StageContext) -> AtenProgram:
        return program
