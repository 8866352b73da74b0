"""Every driver option in one place. The CLI fills this; the API takes it as keywords.

Like MLIR's PassManagerOptions: one struct, one function (`instruments`) that
turns it into what the driver runs, so the CLI can never do something the API
cannot.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, TextIO

import attrs

from compiler.instruments import (
    CrashReproducer,
    DumpStages,
    Instrument,
    PrintAfterChange,
    Timing,
    VerifyEach,
)
from compiler.ir.errors import UserInputError
from compiler.stages import STAGE_NAMES, check_stage_name


@attrs.frozen
class DriverOptions:
    # Check each stage's output against its artifact type's invariants.
    verify: bool = True
    # Write every stage's graph text and resumable file here.
    dump_dir: str | None = None
    # Print a stage's graph after it, when it changed (True: to stderr; or a stream).
    print_after_change: bool | TextIO = False
    # Return the artifact of this stage instead of going on.
    stop_after: str | None = None
    # Start from a stage file (from dump_dir or the reproducer) instead of a model.
    resume_from: str | None = None
    # On a failure, save the failing stage's input here (default: dump_dir, else a temp dir).
    reproducer: bool = True
    reproducer_dir: str | None = None
    # Extra instruments of the caller's, outermost first.
    instruments: tuple[Instrument, ...] = attrs.field(default=(), converter=tuple)
    # Ops the fold stage must not fold (OpOverloads or names like "aten.t.default"),
    # added to its defaults (fills, dequantize); with fold_replace_skip_ops, instead of them.
    fold_skip_ops: tuple = attrs.field(default=(), converter=tuple)
    fold_replace_skip_ops: bool = False

    def __attrs_post_init__(self) -> None:
        if self.stop_after is not None:
            check_stage_name(self.stop_after, "stop_after")

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> "DriverOptions":
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise UserInputError(
                f"unknown driver option(s): {', '.join(unknown)}",
                hint=f"driver options are: {', '.join(sorted(known))}",
            )
        return cls(**kwargs)

    def build_instruments(self, backend_name: str) -> tuple[list[Instrument], Timing, VerifyEach | None]:
        """The instruments these options ask for, outermost first, plus the two the report reads."""
        instruments: list[Instrument] = []
        if self.reproducer:
            instruments.append(
                CrashReproducer(self.reproducer_dir or self.dump_dir, backend_name, STAGE_NAMES)
            )
        instruments.extend(self.instruments)
        if self.dump_dir:
            instruments.append(DumpStages(os.path.expanduser(self.dump_dir), backend_name, STAGE_NAMES))
        if self.print_after_change:
            stream = None if self.print_after_change is True else self.print_after_change
            instruments.append(PrintAfterChange(stream))
        verify = VerifyEach() if self.verify else None
        if verify:
            instruments.append(verify)
        timing = Timing()
        instruments.append(timing)
        return instruments, timing, verify
