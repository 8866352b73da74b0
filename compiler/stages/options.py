"""Each stage's typed options, and `option()`, the field that makes one user-facing.

Light to import (no torch), so the CLI can build its flags from them before torch
loads. A value is checked against the kind its option declares when the options are
built, with the same named error as an unknown option.
"""

from __future__ import annotations

import io
import os
from typing import Any

import attrs

from compiler.ir.errors import UserInputError

# What an option's value may be besides its kind: a path option takes a path object, a
# stream option (print_after_change) a text stream.
PATH = "path"
STREAM = "stream"


def _accepted(kind: type, takes: str | None) -> tuple[type, ...]:
    if takes == PATH:
        return (str, os.PathLike)
    if takes == STREAM:
        return (kind, io.IOBase)
    return (kind,)


def kind_mismatch(value: Any, kind: type, *, repeated: bool = False, optional: bool = False, takes: str | None = None) -> str | None:
    """Why `value` is not of the option's kind (None when it is): `repeated` options take a
    tuple of that kind, `optional` ones None too; a bool is never taken as a number."""
    if value is None and optional:
        return None
    accepted = _accepted(kind, takes)
    values = value if repeated and isinstance(value, (tuple, list)) else (value,)
    for one in values:
        if isinstance(one, bool) and bool not in accepted:
            return f"takes a {kind.__name__}, got the bool {one!r}"
        if not isinstance(one, accepted):
            return f"takes a {kind.__name__}{' (or several)' if repeated else ''}, got {type(one).__name__} {one!r}"
    return None


def _of_its_kind(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    meta = attribute.metadata
    reason = kind_mismatch(
        value, meta["kind"], repeated=isinstance(attribute.default, tuple), optional=attribute.default is None,
        takes=meta["takes"],
    )
    if reason:
        raise UserInputError(
            f"option {type(instance).__name__}.{attribute.name} {reason}",
            hint=f"give a {meta['kind'].__name__}" + (f": one of {', '.join(map(str, meta['choices']))}" if meta["choices"] else ""),
        )


def option(
    default: Any,
    help: str,
    *,
    kind: type | None = None,
    choices: tuple = (),
    metavar: str | None = None,
    converter=None,
    takes: str | None = None,
):
    """An attrs field that is also a user-facing option: its help text, value kind, choices and
    metavar are what the CLI flag and the options table (docs/options.md) are made from; `takes` PATH or STREAM
    widens what a value may be."""
    kind = kind or type(default)
    return attrs.field(
        default=default,
        converter=converter,
        validator=_of_its_kind,
        metadata={"help": help, "kind": kind, "choices": choices, "metavar": metavar, "takes": takes},
    )


def _op_names(ops: Any) -> Any:
    """Ops as their qualified names ("aten.t.default"): an OpOverload given from Python is
    recorded and compared by name, like one given on the command line."""
    if isinstance(ops, str):
        ops = (ops,)
    if not isinstance(ops, (tuple, list)):
        return ops  # the kind check names it
    names = []
    for op in ops:
        if not isinstance(op, str) and callable(op):
            from compiler.ir.dialect import op_name

            op = op_name(op)
        names.append(op)
    return tuple(names)


@attrs.frozen
class NoOptions:
    """The options of a stage that takes none."""


@attrs.frozen
class CaptureOptions:
    strict: bool = option(False, "trace with torch.export's strict mode (TorchDynamo) instead of non-strict")


@attrs.frozen
class FoldOptions:
    skip_ops: tuple[str, ...] = option(
        (), "an op the fold stage must not fold (e.g. aten.t.default), added to its defaults",
        kind=str, metavar="OP", converter=_op_names,
    )
    replace_skip_ops: bool = option(False, "skip only the ops given by fold_skip_ops, not the defaults")


DRY_RUN_MODES = ("auto", "always", "never")


@attrs.frozen
class DryRunOptions:
    mode: str = option(
        "auto",
        "auto: partition a decomposed copy only when a kept op could land on the CPU without a kernel; "
        "always: every time; never: keep whole what the backend asks, as stock ExecuTorch does",
        choices=DRY_RUN_MODES,
    )

    def __attrs_post_init__(self) -> None:
        if self.mode not in DRY_RUN_MODES:
            raise UserInputError(
                f"unknown dry_run_mode {self.mode!r}", stage="dry_run", hint=f"use one of: {', '.join(DRY_RUN_MODES)}"
            )


@attrs.frozen
class EmitOptions:
    extract_delegate_segments: bool = option(
        True, "store delegate payloads as segments after the program (ExecuTorch's default), not inside it"
    )
    stacktrace: bool = option(False, "record each instruction's Python stack trace in the .pte")
