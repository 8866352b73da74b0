"""The compile configuration: every option, typed, declared once.

Each stage's options are a small frozen class (`compiler.stages.options`, light to
import, so the CLI can build its flags from them before torch loads), named by the
stage's row in the table of stages. `CompileConfig` holds the backend, the backend's
options (in the backend's own terms) and every stage's options, one field per stage
that takes any, made from that table: it decides the program, so stage files record
it and a resumed run replays it. `DriverOptions` say how one run is
driven (where to dump, where to stop); they never change the program and are
not replayed.

Options have one name everywhere: `<stage>_<field>` (`fold_skip_ops`) as an API
keyword, `--fold-skip-ops` as a flag; a stage's primary option the stage's name alone
(`quantize`, `--quantize`). `options()` lists them all; the CLI and
the options table (docs/options.md) are generated from it.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import importlib
import json
from typing import Any, Iterator, Mapping, TextIO

import attrs

from compiler.ir import targets
from compiler.ir.errors import UserInputError
from compiler.stages import STAGE_NAMES, STAGE_OPTIONS
from compiler.stages.options import PATH, STREAM, NoOptions, kind_mismatch, option


def _stage_options_field(stage: str):
    return attrs.field(factory=STAGE_OPTIONS[stage], validator=attrs.validators.instance_of(STAGE_OPTIONS[stage]))


@attrs.frozen(
    these={
        "backend": attrs.field(default=targets.DEFAULT),
        # The backend's own options (those of ExecuTorch's partitioner for it); checked by the backend.
        "backend_options": attrs.field(factory=dict, converter=dict),
        # One field per stage that takes options, named after it (`config.fold`: its FoldOptions).
        **{stage: _stage_options_field(stage) for stage in STAGE_OPTIONS},
    }
)
class CompileConfig:
    """Everything that decides the program a compile produces."""

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.backend, str):
            raise UserInputError(
                f"the backend must be named by a string, got {type(self.backend).__name__}",
                hint=f"pass a backend name: one of {', '.join(targets.BY_NAME)}",
            )

    @property
    def program_state(self) -> frozenset[str]:
        """Buffers another method of the program writes (`compile_methods` sets them as the option
        `partition_program_state`): no stage may read them as constants, so every stage is told."""
        return frozenset(self.partition.program_state)

    @property
    def quantizes(self) -> bool:
        """Whether the quantize stage quantizes: by a scheme, or embedding tables alone."""
        return self.quantize.scheme is not None or self.quantize.embedding is not None

    def program_record(self) -> str | None:
        """This configuration as the emitted program records it (JSON), for a compile that
        quantizes: a check of the program alone (`run`) quantizes the model again by it. None
        for one that does not, whose check needs nothing the model does not say."""
        return json.dumps(self.to_json(), sort_keys=True) if self.quantizes else None

    def options_for(self, stage: str) -> Any:
        """The typed options of `stage` (an empty `NoOptions` for stages that take none)."""
        return getattr(self, stage) if stage in STAGE_OPTIONS else NoOptions()

    def with_options(self, given: Mapping[str, Any]) -> "CompileConfig":
        """This configuration with the options `given` (by their one names) set."""
        specs = {spec.name: spec for spec in options()}
        unknown = sorted(name for name in given if name not in specs or not specs[name].in_config)
        if unknown:
            raise UserInputError(
                f"unknown option(s): {', '.join(unknown)}",
                hint=f"options are: {', '.join(s.name for s in options())}",
            )
        by_stage: dict[str, dict[str, Any]] = {}
        for name, value in given.items():
            specs[name].check(value)
            by_stage.setdefault(specs[name].stage, {})[specs[name].field] = value
        return attrs.evolve(self, **{stage: attrs.evolve(getattr(self, stage), **fields) for stage, fields in by_stage.items()})

    def to_json(self) -> dict:
        """The configuration as JSON; backend options are tagged so they load back as the same
        objects (enums, classes, compile specs). One that cannot be is recorded by its repr
        under "unrecorded", and a resume must be given it again."""
        recorded, unrecorded = {}, {}
        for key, value in self.backend_options.items():
            try:
                recorded[key] = encode(value)
            except ValueError:
                unrecorded[key] = repr(value)
        stages = {name: attrs.asdict(getattr(self, name)) for name in STAGE_OPTIONS}
        data = {"backend": self.backend, "backend_options": recorded, "stages": stages}
        if unrecorded:
            data["unrecorded"] = unrecorded
        return _lists(data)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "CompileConfig":
        stages = {
            name: STAGE_OPTIONS[name](**fields) for name, fields in data.get("stages", {}).items() if name in STAGE_OPTIONS
        }
        options = {key: decode(value) for key, value in data.get("backend_options", {}).items()}
        return cls(data["backend"], options, **stages)


def _lists(value: Any) -> Any:
    """Tuples as JSON lists, recursively (so a saved and a fresh config compare equal as JSON)."""
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    return value


@attrs.frozen
class DriverOptions:
    """How one run is driven; none of these changes the program, so none is replayed."""

    verify: bool = option(
        True, "check each stage's output against its artifact type's invariants",
        off="skip checking each stage's output (a stage's bad output then shows later, if at all)",
    )
    dump_dir: str | None = option(
        None, "write each stage's graph and resumable stage file here", kind=str, metavar="DIR", takes=PATH
    )
    print_after_change: bool | TextIO = option(
        False, "print a stage's graph after it when it changed it", kind=bool, takes=STREAM
    )
    capture_dependency_output: bool = option(
        True, "keep what dependencies print, warn and log off the terminal: it goes into the report's stage messages",
        off="let dependencies print, warn and log to the terminal as they run",
    )
    stop_after: str | None = option(None, "stop after this stage and return its artifact", kind=str, choices=STAGE_NAMES)
    resume_from: str | None = option(
        None, "continue the run recorded in this stage file (its backend and options, unless given)", kind=str, metavar="FILE",
        takes=PATH,
    )
    reproducer: bool = option(
        True, "on a failure, save the failing stage's input as a stage file, in reproducer_dir",
        off="save nothing when a stage fails",
    )
    reproducer_dir: str | None = option(
        None, "where the failing stage's input is saved (default: dump_dir; with neither, the API saves nothing and "
        "the CLI uses the cache folder $XDG_CACHE_HOME/staged-compiler/reproducers, else ~/.cache/..., where each "
        "failure gets its own folder and the newest 20 are kept)", kind=str, metavar="DIR", takes=PATH,
    )
    memory_check: bool = option(
        True, "refuse, before it starts, a compile the machine has not the memory for (an estimate from the model's "
        "weights against the memory available)",
        off="start the compile whatever memory it is estimated to need",
    )
    dependency_checks: bool = option(
        False, "also run the checks ExecuTorch's to_backend and coremltools repeat after every step "
        "(slow; for debugging a dependency)"
    )
    cache: bool = option(
        True, "load a stage's output from the stage cache when its inputs, options and versions are unchanged, "
        "and store what ran there (a run with dump_dir, print_after_change or resume_from does not load); the CLI's "
        "compile and sweeps also take a whole program from it by the MODEL spec, options and versions, with no capture",
        off="compile every stage, neither loading from the stage cache nor storing in it"
    )
    cache_dir: str | None = option(
        None, "the stage cache's folder (without it, the API caches nothing and the CLI uses "
        "$XDG_CACHE_HOME/staged-compiler/stages, else ~/.cache/...)", kind=str, metavar="DIR", takes=PATH,
    )
    cache_max_mb: int = option(
        4096, "the stage cache's size limit in MB: the least recently used entries go beyond it", metavar="MB"
    )
    # Extra instruments of the caller's, outermost first (API only).
    instruments: tuple = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self) -> None:
        if self.stop_after is not None and self.stop_after not in STAGE_NAMES:
            raise UserInputError(
                f"unknown stage {self.stop_after!r} for stop_after", hint=f"use one of: {', '.join(STAGE_NAMES)}"
            )


@attrs.frozen
class OptionSpec:
    """One user-facing option: where it lives and how it is shown."""

    name: str  # the one name: API keyword, `--flag-form`, docs row
    stage: str | None  # the stage it belongs to; None for driver options and the backend
    field: str
    kind: type
    default: Any
    help: str
    choices: tuple = ()
    metavar: str | None = None
    in_config: bool = True  # False: a DriverOptions field
    takes: str | None = None  # what a value may be besides its kind (compiler.stages.options)
    converter: Any = None  # the field's, applied before the kind is checked (op objects to names)
    off: str | None = None  # what the `--no-` flag of an option on by default does

    def check(self, value: Any) -> None:
        """A `UserInputError` naming this option when `value` is not of its kind."""
        if self.converter is not None:
            value = self.converter(value)
        reason = kind_mismatch(value, self.kind, repeated=self.repeated, optional=self.default is None, takes=self.takes)
        if reason:
            choices = f": one of {', '.join(map(str, self.choices))}" if self.choices else ""
            raise UserInputError(f"option {self.name} {reason}", hint=f"give a {self.kind.__name__}{choices}")

    @property
    def flag(self) -> str:
        if self.kind is bool and self.default is True:
            return "--no-" + self.name.replace("_", "-")
        return "--" + self.name.replace("_", "-")

    @property
    def flag_help(self) -> str:
        return self.off if self.flag.startswith("--no-") and self.off else self.help

    @property
    def repeated(self) -> bool:
        return isinstance(self.default, tuple)


def _specs(cls: type, stage: str | None, in_config: bool) -> Iterator[OptionSpec]:
    for f in attrs.fields(cls):
        if "help" not in f.metadata:
            continue
        meta = f.metadata
        name = meta.get("name") or (stage if meta.get("primary") else f"{stage}_{f.name}" if stage else f.name)
        yield OptionSpec(
            name, stage, f.name, meta["kind"], f.default, meta["help"], meta["choices"], meta["metavar"], in_config,
            meta["takes"], f.converter, meta.get("off"),
        )


def options() -> tuple[OptionSpec, ...]:
    """Every option a user can set, stage options in pipeline order, then driver options."""
    specs = [spec for stage in STAGE_NAMES if stage in STAGE_OPTIONS for spec in _specs(STAGE_OPTIONS[stage], stage, True)]
    specs += _specs(DriverOptions, None, False)
    return tuple(specs)


def split_options(given: Mapping[str, Any]) -> tuple[dict[str, Any], DriverOptions]:
    """Keyword options by their one names -> (the configuration's, the run's)."""
    specs = {spec.name: spec for spec in options()}
    run_fields = {f.name for f in attrs.fields(DriverOptions)}
    unknown = sorted(name for name in given if name not in specs and name not in run_fields)
    if unknown:
        raise UserInputError(
            f"unknown option(s): {', '.join(unknown)}",
            hint=f"options are: {', '.join(sorted([*specs, 'instruments']))}",
        )
    for name, value in given.items():
        if name in specs:
            specs[name].check(value)
    config = {name: value for name, value in given.items() if name in specs and specs[name].in_config}
    run = DriverOptions(**{name: value for name, value in given.items() if name not in config})
    return config, run


def options_table() -> str:
    """The Markdown table of every option (generated into docs/options.md)."""
    lines = ["| of | API keyword | CLI flag | default | what it does |", "|---|---|---|---|---|"]
    for spec in options():
        default = "-" if spec.default in (None, ()) else f"`{spec.default!r}`"
        flag = spec.flag + (" (repeat)" if spec.repeated else "")
        choices = f" ({' / '.join(spec.choices)})" if spec.choices and spec.stage else ""
        what = spec.help + (f" (`{spec.flag}`: {spec.off})" if spec.off else "")
        lines.append(f"| {spec.stage or 'driver'} | `{spec.name}` | `{flag}` | {default} | {what}{choices} |")
    return "\n".join(lines)


# --- backend options as JSON --------------------------------------------------------

# Modules a stage file may name to rebuild a backend option (a class, an enum): loading a
# file never imports anything else.
_TRUSTED_MODULES = ("executorch.", "coremltools", "torch")


def _qualified(obj: Any) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


def _resolve(qualified: str) -> Any:
    module, _, name = qualified.partition(":")
    if not module.startswith(_TRUSTED_MODULES):
        raise ValueError(f"refusing to import {module!r} from a stage file")
    value = importlib.import_module(module)
    for part in name.split("."):
        value = getattr(value, part)
    return value


def encode(value: Any) -> Any:
    """A backend option as JSON that `decode` turns back into an equal value; ValueError when
    it has no such form."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return {"$list" if isinstance(value, list) else "$tuple": [encode(v) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"$dict": {k: encode(v) for k, v in value.items()}}
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode()}
    if isinstance(value, enum.Enum):
        return {"$enum": _qualified(type(value)), "name": value.name}
    if isinstance(value, type) and value.__module__.startswith(_TRUSTED_MODULES):
        return {"$type": _qualified(value)}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return {"$dtype": str(value).removeprefix("torch.")}
    if dataclasses.is_dataclass(value) and type(value).__module__.startswith(_TRUSTED_MODULES):
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"$dataclass": _qualified(type(value)), "fields": fields}
    raise ValueError(f"no JSON form for a {type(value).__name__}")


def decode(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    if "$list" in data:
        return [decode(v) for v in data["$list"]]
    if "$tuple" in data:
        return tuple(decode(v) for v in data["$tuple"])
    if "$dict" in data:
        return {k: decode(v) for k, v in data["$dict"].items()}
    if "$bytes" in data:
        return base64.b64decode(data["$bytes"])
    if "$enum" in data:
        return _resolve(data["$enum"])[data["name"]]
    if "$type" in data:
        return _resolve(data["$type"])
    if "$dtype" in data:
        import torch

        return getattr(torch, data["$dtype"])
    if "$dataclass" in data:
        return _resolve(data["$dataclass"])(**{k: decode(v) for k, v in data["fields"].items()})
    raise ValueError(f"unknown tagged value {sorted(data)}")


_DEPENDENCIES = ("torch", "executorch", *(name for target in targets.TARGETS for name in target.dependencies))


def dependency_versions() -> dict[str, str | None]:
    """The installed versions that decide what a compile produces (None: not installed)."""
    from importlib import metadata

    found: dict[str, str | None] = {}
    for name in _DEPENDENCIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found
