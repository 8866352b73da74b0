"""Capture: nn.Module + example inputs -> ATen program, through torch.export.

Export runs under `torch.no_grad()`: otherwise methods decorated with
`@torch.no_grad` (common in policy code) become `wrap_with_set_grad_enabled`
submodules that no backend takes.
"""

from __future__ import annotations

import torch

from compiler.ir.artifacts import AtenProgram, EagerModel
from compiler.ir.errors import CaptureError
from compiler.stages.base import Stage, StageContext


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
        return AtenProgram(program)
