"""The stages, in pipeline order. This order is the one registry of stage names:
it drives `stop_after`, `resume_from`, the dump file names and the CLI choices.
"""

from __future__ import annotations

from compiler.ir.errors import UserInputError
from compiler.stages.base import Stage, StageContext
from compiler.stages.capture import Capture
from compiler.stages.decompose import Decompose
from compiler.stages.dry_run import DryRun
from compiler.stages.emit import Emit
from compiler.stages.fold import Fold
from compiler.stages.lower import Lower
from compiler.stages.partition import Partition
from compiler.stages.split_constants import SplitConstants

DEFAULT_STAGES: tuple[Stage, ...] = (
    Capture(),
    Fold(),
    DryRun(),
    Decompose(),
    Partition(),
    SplitConstants(),
    Lower(),
    Emit(),
)

STAGE_NAMES: tuple[str, ...] = tuple(stage.name for stage in DEFAULT_STAGES)


def check_stage_name(name: str, option: str) -> str:
    if name not in STAGE_NAMES:
        raise UserInputError(
            f"unknown stage {name!r} for {option}",
            hint=f"use one of: {', '.join(STAGE_NAMES)}",
        )
    return name


__all__ = ["DEFAULT_STAGES", "STAGE_NAMES", "Stage", "StageContext", "check_stage_name"]
