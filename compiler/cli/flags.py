"""The CLI's flags: one per option of `compiler.driver.config.options()` (generated, under the
option's own name), the flags every job command shares (one parent parser, its defaults the
configuration's), and errors shown with flags where the API's name keywords."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from typing import Any, Mapping, Sequence

from compiler import backends
from compiler.driver import config, dynamic_dims
from compiler.ir.errors import CompileError, UserInputError
from compiler.models import catalog
from compiler.running.tolerance import FLOAT16_OF_LARGEST, FLOAT32_ABSOLUTE

RESUME = "python -m compiler compile --resume-from {path}"
DEFAULT_BACKEND = config.CompileConfig().backend
# The job's keywords that are not options of the configuration, as the flags that give them.
JOB_KEYWORDS = {
    "locate=True": "--locate", "check=True": "--check", "calibration_file": "--calibration",
    "calibration_draws": "--calibration-draws", "dynamic_dim": "--dynamic-dim", "output_dir": "--output-dir",
}


def backend_flags(default_note: str = "") -> argparse.ArgumentParser:
    """--backend and --backend-option, as every job command takes them (default: the configuration's)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--backend", choices=backends.available(), default=None if default_note else DEFAULT_BACKEND,
        help=f"where the program runs (default: {DEFAULT_BACKEND}{default_note})",
    )
    parent.add_argument(
        "--backend-option", action="append", default=[], metavar="KEY=VALUE",
        help="an option of the backend's partitioner (VALUE is read as JSON, else as a string)",
    )
    return parent


def add_tolerance_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--tolerance", type=float, default=None,
        help=f"max abs error {what} accepts (default: {FLOAT32_ABSOLUTE:g} for a program computing "
        f"in float32; {FLOAT16_OF_LARGEST:g} x the largest eager output when a delegate computes "
        "in float16)",
    )


def add_check_nodes_flag(parser: argparse.ArgumentParser, of_what: str) -> None:
    parser.add_argument(
        "--check-nodes", action="store_true",
        help=f"compare every node of {of_what} (inside delegates too) with eager's op on the same inputs, each at a "
        "tolerance for its own precision and magnitude (compiler.check_nodes): finds what the outputs hide",
    )


def add_dynamic_dim_flag(parser: argparse.ArgumentParser, check: str) -> None:
    parser.add_argument(
        "--dynamic-dim", action="append", default=[], type=_dynamic_dim, metavar=dynamic_dims.FORM,
        help=f"{dynamic_dims.HELP} ({check} also runs with every dynamic size at its MIN, then at its MAX)",
    )


def add_calibration_flags(command: argparse.ArgumentParser, scheme: str) -> None:
    calibration = command.add_mutually_exclusive_group()
    calibration.add_argument(
        "--calibration", metavar="FILE",
        help=f"calibration inputs for {scheme}: a torch.save'd list of input tuples",
    )
    calibration.add_argument(
        "--calibration-draws", type=int, metavar="N",
        help="calibrate on N draws of inputs from the model factory (one that takes a seed keyword, as the "
        "built-in models do)",
    )


def add_task_flag(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--task", choices=catalog.TASKS,
        help="what to compile of a save_pretrained MODEL folder (optimum-executorch's task names; text-generation: "
        "the decoder step with its KV cache, as `generate` compiles it)",
    )


def add_option_flags(parser: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
    """One flag per option of `compiler.driver.config.options()` (or of those named in `only`). Flags
    left out are absent from the parsed namespace (SUPPRESS), so a resume can tell what was
    given from a default."""
    for spec in config.options():
        if only is not None and spec.name not in only:
            continue
        kwargs: dict[str, Any] = {"dest": spec.name, "default": argparse.SUPPRESS, "help": spec.flag_help}
        if spec.kind is bool:
            kwargs["action"] = "store_false" if spec.default is True else "store_true"
        else:
            kwargs.update(type=spec.kind, metavar=spec.metavar, choices=spec.choices or None)
            if spec.repeated:
                kwargs["action"] = "append"
        parser.add_argument(spec.flag, **kwargs)


def as_flags(options: Mapping[str, Any]) -> str:
    """Options by their configuration names, as the flags that set them."""
    specs = {spec.name: spec for spec in config.options()}
    shown = []
    for name, value in options.items():
        spec = specs.get(name)
        if name == "backend":
            shown.append(f"--backend {value}")
        elif spec is None:
            shown.append(f"--backend-option {name}={json.dumps(value)}")
        elif spec.kind is bool:
            if value != spec.default:
                shown.append(spec.flag)
        else:
            values = value if spec.repeated else [value]
            shown += [f"{spec.flag} {shlex.quote(str(v))}" for v in values]
    return " ".join(shown)


def render_error(error: CompileError) -> str:
    """The error as the CLI shows it: options suggested as flags, and the API's keywords in the
    reason and the advice named by the flags that give them."""
    text = error.render(as_flags, RESUME)
    for keyword, flag in _keyword_flags().items():
        text = re.sub(rf"(?<![\w/.-]){re.escape(keyword)}(?![\w=/-])", flag, text)
    if error.__cause__ is not None and not isinstance(error, UserInputError):  # a mistake's advice is the hint
        text += "\n  --traceback shows where it failed"
    return text


def _keyword_flags() -> dict[str, str]:
    """Each keyword that is one word of snake_case (`quantize_granularity`), and the job's own, -> its flag."""
    named = {spec.name: spec.flag for spec in config.options() if "_" in spec.name}
    return {**named, **JOB_KEYWORDS}


def _dynamic_dim(text: str) -> dynamic_dims.DynamicDim:
    try:
        return dynamic_dims.parse(text)
    except UserInputError as error:  # argparse names the flag
        raise argparse.ArgumentTypeError(f"{error.reason}; {error.hint}") from None


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options the flags gave, by their configuration names (left-out flags are absent)."""
    given = {spec.name: getattr(args, spec.name) for spec in config.options() if hasattr(args, spec.name)}
    if given.get("print_after_change"):
        given["print_after_change"] = sys.stdout
    return given


