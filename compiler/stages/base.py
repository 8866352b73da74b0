"""What every stage is: a name, the artifact type it takes, the one it returns, its options, a run."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import attrs

from compiler.backends.base import Backend
from compiler.config import NoOptions


@attrs.define
class StageContext:
    """What a stage may use besides its input: the backend, its own options, and a place
    for its numbers."""

    backend: Backend
    # This stage's options: an instance of the stage's `options` class.
    options: Any = attrs.field(factory=NoOptions)
    # The run option `dependency_checks`: let dependencies repeat their own checks (lower).
    dependency_checks: bool = False
    # Numbers the stage wants in the report (e.g. constants folded); filled by `run`.
    metrics: dict[str, Any] = attrs.field(factory=dict)


class Stage(abc.ABC):
    """Declared in one line: `class Fold(Stage, name="fold", takes=AtenProgram,
    returns=AtenProgram, options=FoldOptions)`."""

    name: ClassVar[str]
    takes: ClassVar[type]
    returns: ClassVar[type]
    # The options this stage reads (a frozen attrs class from compiler.config).
    options: ClassVar[type] = NoOptions

    def __init_subclass__(cls, *, name: str, takes: type, returns: type, options: type = NoOptions, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.name, cls.takes, cls.returns, cls.options = name, takes, returns, options

    @abc.abstractmethod
    def run(self, artifact: Any, ctx: StageContext) -> Any:
        """Turn an artifact of type `takes` into one of type `returns`."""

    def check_options(self, options: Any) -> None:
        """Raise a `UserInputError` for options this stage cannot use. The driver asks every
        stage that will run before the first one starts, so a mistyped option costs no work."""

    def __repr__(self) -> str:
        return f"<stage {self.name}: {self.takes.__name__} -> {self.returns.__name__}>"
