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
from compiler.ir.targets import TARGETS
from compiler.stages.schemes import EMBEDDING_SCHEMES, GRANULARITIES, SCHEME_NAMES

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
    primary: bool = False,
    name: str | None = None,
    off: str | None = None,
):
    """An attrs field that is also a user-facing option: its help text, value kind, choices and
    metavar are what the CLI flag and the options table (docs/options.md) are made from; `takes` PATH or STREAM
    widens what a value may be. A stage's `primary` option is named by the stage alone
    (`quantize`, `--quantize SCHEME`), one given a `name` by it (an option users know by that name),
    the others `<stage>_<field>`. An option on by default says in `off` what its `--no-` flag does."""
    kind = kind or type(default)
    if default is True and not off:
        raise TypeError("an option on by default needs the help of its --no- flag (off=...)")
    return attrs.field(
        default=default,
        converter=converter,
        validator=_of_its_kind,
        metadata={
            "help": help, "kind": kind, "choices": choices, "metavar": metavar, "takes": takes, "primary": primary,
            "name": name, "off": off,
        },
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


def _one_of(name: str, choices: tuple[str, ...], stage: str):
    def validate(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and value not in choices:
            raise UserInputError(f"unknown {name} {value!r}", stage=stage, hint=f"use one of: {', '.join(choices)}")

    return validate


@attrs.frozen
class QuantizeOptions:
    scheme: str | None = option(
        None, "quantize the model with this scheme before capture (docs/quantization.md lists which backends take "
        "which); static schemes need calibration inputs", kind=str, choices=SCHEME_NAMES, metavar="SCHEME", primary=True,
    )
    granularity: str | None = option(
        None, "how weight scales are shared: per_channel, per_group (of group_size input channels) or per_tensor "
        "(default: the scheme's first for the backend)", kind=str, choices=GRANULARITIES,
    )
    group_size: int = option(32, "input channels per weight scale, for per_group granularity (and a codebook's block)")
    bits: int = option(4, "bits per codebook index (codebook scheme: a table of 2**bits values per block)")
    embedding: str | None = option(
        None, "also quantize nn.Embedding tables, weight-only (4w or 8w)", kind=str, choices=EMBEDDING_SCHEMES,
    )
    embedding_group_size: int = option(32, "embedding columns per scale (0: one scale per row)")

    def __attrs_post_init__(self) -> None:
        for name, value, choices in (
            ("quantize scheme", self.scheme, SCHEME_NAMES),
            ("granularity", self.granularity, GRANULARITIES),
            ("embedding scheme", self.embedding, EMBEDDING_SCHEMES),
        ):
            _one_of(name, choices, "quantize")(self, None, value)
        if self.group_size <= 0 or self.embedding_group_size < 0:
            raise UserInputError(
                f"group sizes must be positive (group_size {self.group_size}, embedding_group_size "
                f"{self.embedding_group_size})", stage="quantize", hint="give e.g. 32, 64 or 128",
            )
        if not 1 <= self.bits <= 8:
            raise UserInputError(f"quantize_bits {self.bits} is not in 1..8", stage="quantize", hint="give 2, 4 or 8")


PRECISIONS = ("auto", "model", "float32", "float16")


@attrs.frozen
class PrecisionOptions:
    dtype: str = option(
        "auto", "the floating dtype the program computes in: auto: a bfloat16 model computes in float32 on backends "
        f"without bfloat16 kernels ({', '.join(t.name for t in TARGETS if t.no_bfloat16)}; inside a delegate its own "
        "compute precision applies), cast at the program's edges; model: as the model is; float32 / float16: every "
        "floating tensor in that dtype",
        choices=PRECISIONS, primary=True,
    )

    def __attrs_post_init__(self) -> None:
        _one_of("precision", PRECISIONS, "precision")(self, None, self.dtype)


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


def _entries(given: Any) -> Any:
    """One entry or several as a tuple (a list from a stage file's JSON compares equal to it)."""
    if isinstance(given, str):
        return (given,)
    return tuple(given) if isinstance(given, list) else given


@attrs.frozen
class PartitionOptions:
    program_state: tuple[str, ...] = option(
        (), "buffers read at run time by every stage, never as constants (folded, or in a delegate's payload "
        "where it only reads them): state another method of the program writes (compile_methods sets it)",
        kind=str, metavar="BUFFER", converter=_entries,
    )


@attrs.frozen
class EmitOptions:
    extract_delegate_segments: bool = option(
        True, "store delegate payloads as segments after the program (ExecuTorch's default), not inside it",
        off="store delegate payloads inside the program's flatbuffer, not as segments after it",
    )
    stacktrace: bool = option(False, "record each instruction's Python stack trace in the .pte")
    external_weights: bool = option(
        False, "write the weights (the CPU's and the delegates' that their runtime reads as named data) to a "
        "data file, OUTPUT.ptd beside OUTPUT.pte, which ExecuTorch's runtime loads with the program",
        name="external_weights",
    )
    constant_methods: tuple[str, ...] = option(
        (), "a method NAME=VALUE the .pte also holds that returns VALUE (an int, a float, true / false, or "
        "ints separated by commas), as ExecuTorch's LLM runners read their metadata (get_max_seq_len=128)",
        kind=str, metavar="NAME=VALUE", converter=_entries,
    )

    def __attrs_post_init__(self) -> None:
        constant_method_values(self.constant_methods)


_CONSTANT_METHOD_HINT = "give NAME=VALUE: an identifier other than forward, and an int, a float, true, false or ints a,b,c"


def _constant(name: str, text: str) -> bool | int | float | list[int]:
    if text in ("true", "false"):
        return text == "true"
    try:
        if "," in text:
            return [int(item) for item in text.split(",") if item]
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise UserInputError(
            f"emit_constant_methods: the value {text!r} of {name!r} is not a number, a bool or a list of ints",
            stage="emit", hint=_CONSTANT_METHOD_HINT,
        ) from None


def constant_method_values(entries: tuple[str, ...]) -> dict[str, bool | int | float | list[int]]:
    """The emit stage's constant methods as ExecuTorch's `constant_methods` (name -> value); the
    option keeps the NAME=VALUE text, so the configuration records it as the user gave it."""
    values: dict[str, bool | int | float | list[int]] = {}
    for entry in entries:
        name, equals, text = entry.partition("=")
        if not equals or not name.isidentifier() or name == "forward" or not text or ";" in text:
            raise UserInputError(
                f"emit_constant_methods: {entry!r} is not NAME=VALUE", stage="emit", hint=_CONSTANT_METHOD_HINT
            )
        if name in values:
            raise UserInputError(
                f"emit_constant_methods: {name!r} is given twice", stage="emit", hint="give each method once"
            )
        values[name] = _constant(name, text)
    return values
