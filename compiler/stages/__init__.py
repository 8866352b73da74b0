"""The one table of stages, in pipeline order.

Each row names a stage, the class that runs it (in `compiler/stages/<name>.py`) and its
options class (`compiler.stages.options`). The configuration's stage options, the CLI's
choices, `stop_after`, the option table (docs/options.md) and the dump file names all derive
from it: adding a stage is one row here and its module. This module is light (no
torch), so the CLI can build its flags before torch loads; `default_stages()` imports
the stages themselves.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

import attrs

from compiler.stages.options import (
    CaptureOptions,
    DryRunOptions,
    EmitOptions,
    FoldOptions,
    NoOptions,
    PartitionOptions,
    PrecisionOptions,
    QuantizeOptions,
)

if TYPE_CHECKING:
    from compiler.stages.base import Stage


@attrs.frozen
class StageRow:
    name: str  # also the module: compiler/stages/<name>.py
    class_name: str
    options: type = NoOptions

    @property
    def module(self) -> str:
        return f"{__name__}.{self.name}"

    def load(self) -> type[Stage]:
        return getattr(importlib.import_module(self.module), self.class_name)


STAGES: tuple[StageRow, ...] = (
    StageRow("quantize", "Quantize", QuantizeOptions),
    StageRow("capture", "Capture", CaptureOptions),
    StageRow("precision", "Precision", PrecisionOptions),
    StageRow("fold", "Fold", FoldOptions),
    StageRow("dry_run", "DryRun", DryRunOptions),
    StageRow("decompose", "Decompose"),
    StageRow("partition", "Partition", PartitionOptions),
    StageRow("split_constants", "SplitConstants"),
    StageRow("lower", "Lower"),
    StageRow("emit", "Emit", EmitOptions),
)

STAGE_NAMES: tuple[str, ...] = tuple(row.name for row in STAGES)

# Stage name -> its options class, for the stages that take any.
STAGE_OPTIONS = {row.name: row.options for row in STAGES if row.options is not NoOptions}


def row_for_module(module: str) -> StageRow | None:
    return next((row for row in STAGES if row.module == module), None)


def default_stages() -> tuple[Stage, ...]:
    """The pipeline's stages, one instance each (importing them, torch and ExecuTorch with them)."""
    return tuple(row.load()() for row in STAGES)


__all__ = ["STAGES", "STAGE_NAMES", "STAGE_OPTIONS", "StageRow", "default_stages"]
