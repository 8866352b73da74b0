"""What every stage is: a name, the artifact type it takes, the one it returns, its options, a run."""

from __future__ import annotations

import abc
import contextlib
from typing import Any, ClassVar, ContextManager

import attrs

from compiler.backends.base import Backend
from compiler.ir.errors import PipelineError
from compiler.ir.private_api import exported_program_validation_skipped
from compiler.reporting.report import Metric
from compiler.stages import row_for_module
from compiler.stages.options import NoOptions


@attrs.define
class StageContext:
    """What a stage may use besides its input: the backend, its own options, and a place
    for its numbers."""

    backend: Backend
    # This stage's options: an instance of the stage's `options` class.
    options: Any = attrs.field(factory=NoOptions)
    # The run option `dependency_checks`: let dependencies repeat their own checks (lower).
    dependency_checks: bool = False
    # Buffers another method of the program writes (`CompileConfig.program_state`): every stage
    # reads them at run time, none as a constant (fold, the partitions' payloads).
    program_state: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset)
    # The configuration the emitted program records (`CompileConfig.program_record`), or None.
    recorded_config: str | None = None
    # Numbers the stage wants in the report (e.g. constants folded); filled by `apply`.
    metrics: dict[str, Any] = attrs.field(factory=dict)

    def program_checks_skipped(self) -> ContextManager[None]:
        """No whole-program validation by torch or ExecuTorch inside the block, unless the run
        asked for `dependency_checks`: each ExportedProgram built there validates itself, and
        our verification validates the stage's output once (`program_validates`)."""
        return contextlib.nullcontext() if self.dependency_checks else exported_program_validation_skipped()


class Stage(abc.ABC):
    """Declared in one line: `class Fold(Stage, takes=AtenProgram, returns=AtenProgram)`; a
    stage of the table (`compiler.stages.STAGES`) takes its name and options from its row,
    one of a pipeline of the caller's names them (`name=`, `options=`)."""

    name: ClassVar[str]
    takes: ClassVar[type]
    returns: ClassVar[type]
    # The options this stage reads (a frozen attrs class, `compiler.stages.options`).
    options: ClassVar[type] = NoOptions
    # What it may put in `ctx.metrics` for the report: each key's unit and wording.
    metrics: ClassVar[tuple[Metric, ...]] = ()

    def __init_subclass__(
        cls, *, takes: type, returns: type, name: str | None = None, options: type | None = None, **kwargs
    ) -> None:
        super().__init_subclass__(**kwargs)
        row = row_for_module(cls.__module__) if name is None else None
        if name is None and row is None:
            raise TypeError(f"stage {cls.__qualname__} is not in compiler.stages.STAGES: give it a name=")
        cls.name = row.name if row else name
        cls.options = row.options if row else (options or NoOptions)
        cls.takes, cls.returns = takes, returns

    @abc.abstractmethod
    def apply(self, artifact: Any, ctx: StageContext) -> Any:
        """Turn an artifact of type `takes` into one of type `returns`."""

    def phrase(self, key: str, value: Any) -> str:
        """A metric this stage reported, in words; one it does not declare is our bug, named."""
        for metric in self.metrics:
            if metric.name == key:
                return metric.phrase(value)
        raise PipelineError(
            f"stage {self.name!r} reported the metric {key!r}, which it does not declare",
            stage=self.name, hint="declare it in the stage's `metrics` (name, unit, wording)",
        )

    def check_options(self, options: Any) -> None:
        """Raise a `UserInputError` for options this stage cannot use. The driver asks every
        stage that will run before the first one starts, so a mistyped option costs no work."""

    def __repr__(self) -> str:
        return f"<stage {self.name}: {self.takes.__name__} -> {self.returns.__name__}>"
