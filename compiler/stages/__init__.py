"""The stages, in pipeline order (the order `compiler.config.STAGE_NAMES` registers):
it drives `stop_after`, `resume_from`, the dump file names and the CLI choices.
"""

from __future__ import annotations

from compiler.config import STAGE_NAMES, STAGE_OPTIONS, NoOptions
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

assert tuple(s.name for s in DEFAULT_STAGES) == STAGE_NAMES, "compiler.config.STAGE_NAMES is the pipeline's order"
assert all(s.options is STAGE_OPTIONS.get(s.name, NoOptions) for s in DEFAULT_STAGES), "a stage's options are registered"


__all__ = ["DEFAULT_STAGES", "STAGE_NAMES", "Stage", "StageContext"]
