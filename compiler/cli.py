"""`python -m compiler`: a thin layer over the Python API.

The option flags are generated from `compiler.config.options()` (one flag per
option, under the option's own name), so the CLI cannot offer what the API does
not. This module is the only one that prints for the user, spells options as
flags, or decides an exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import traceback
from typing import Any, Mapping, Sequence

from compiler import api, backends, config, runtime
from compiler.examples import EXAMPLES, MODELS, describe, resolve_model
from compiler.ir.errors import CompileError, UserInputError
from compiler.ir.serialize import save_stage_file, can_save

RESUME = "python -m compiler compile --resume-from {path}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m compiler", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    compile_cmd = commands.add_parser("compile", help="compile a model to an ExecuTorch .pte")
    compile_cmd.add_argument(
        "model",
        nargs="?",
        help="a built-in example (name[:key=value,...]) or path/to/file.py:factory; "
        "optional with --resume-from unless --check",
    )
    compile_cmd.add_argument(
        "--backend",
        choices=backends.available(),
        help="where the program runs (default: portable; with --resume-from: the recorded one)",
    )
    compile_cmd.add_argument(
        "--backend-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the backend's partitioner (VALUE is read as JSON, else as a string)",
    )
    compile_cmd.add_argument("-o", "--output", help="write the .pte here (with --stop-after: the stage file)")
    _add_option_flags(compile_cmd)
    compile_cmd.add_argument("--check", action="store_true", help="run the .pte and compare with eager PyTorch")
    _add_tolerance_flag(compile_cmd, "--check")
    compile_cmd.add_argument("--report-json", metavar="FILE", help="also write the report as JSON")
    compile_cmd.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    compile_cmd.add_argument("-v", "--verbose", action="store_true", help="log what the stages do")

    run_cmd = commands.add_parser(
        "run",
        help="run any .pte (ours, or one built elsewhere, e.g. by stock ExecuTorch) on a model's example "
        "inputs and compare with eager PyTorch",
    )
    run_cmd.add_argument("program", metavar="PROGRAM.pte")
    run_cmd.add_argument("model", help="the model the program was built from, as compile's MODEL")
    _add_tolerance_flag(run_cmd, "the comparison")
    run_cmd.add_argument("--traceback", action="store_true", help="show the full traceback on errors")

    commands.add_parser("examples", help="list the built-in example models")

    fuzz_cmd = commands.add_parser(
        "fuzz", help="compile random programs with ours and stock ExecuTorch; compare both with eager"
    )
    fuzz_cmd.add_argument(
        "--backend", choices=backends.available(), help="default: portable (with --replay: the file's backend)"
    )
    fuzz_cmd.add_argument("--examples", type=int, default=100, help="how many programs to draw")
    fuzz_cmd.add_argument("--seed", type=int, default=0, help="the same seed draws the same programs")
    fuzz_cmd.add_argument("--out-dir", default="fuzz-failures", help="where failing programs are written as reproducers")
    fuzz_cmd.add_argument("--no-stock", action="store_true", help="do not run the stock ExecuTorch path")
    fuzz_cmd.add_argument("--no-shrink", action="store_true", help="do not shrink the first failure of each kind")
    fuzz_cmd.add_argument("--replay", metavar="FILE", help="run one reproducer file instead")
    return parser


def _add_tolerance_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--tolerance", type=float, default=None,
        help=f"max abs error {what} accepts (default: {runtime.FLOAT32_ABSOLUTE:g} for a program computing "
        f"in float32; {runtime.FLOAT16_OF_LARGEST:g} x the largest eager output when a delegate computes "
        "in float16)",
    )


def _add_option_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per option of `compiler.config.options()`. Flags left out are absent from
    the parsed namespace (SUPPRESS), so a resume can tell what was given from a default."""
    for spec in config.options():
        kwargs: dict[str, Any] = {"dest": spec.name, "default": argparse.SUPPRESS, "help": spec.flag_help}
        if spec.kind is bool:
            kwargs["action"] = "store_false" if spec.default is True else "store_true"
        else:
            kwargs.update(type=spec.kind, metavar=spec.metavar, choices=spec.choices or None)
            if spec.repeated:
                kwargs["action"] = "append"
        parser.add_argument(spec.flag, **kwargs)


def _flags(options: Mapping[str, Any]) -> str:
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
    text = error.render(_flags, RESUME)
    if error.__cause__ is not None:
        text += "\n  --traceback shows where it failed"
    return text


def _backend_options(items: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise UserInputError(f"--backend-option {item!r} is not KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def given_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options the flags gave, by their configuration names (left-out flags are absent)."""
    given = {spec.name: getattr(args, spec.name) for spec in config.options() if hasattr(args, spec.name)}
    if given.get("print_after_change"):
        given["print_after_change"] = sys.stdout
    return given


def _compile(args: argparse.Namespace) -> int:
    resume_from = getattr(args, "resume_from", None)
    if not args.model and not resume_from:
        raise UserInputError("compile needs a MODEL (or --resume-from FILE)", hint="see `python -m compiler examples`")
    if args.check and not args.model:
        raise UserInputError("--check needs the MODEL to compare with", hint="pass MODEL along with --resume-from")
    module, inputs, dynamic_shapes = resolve_model(args.model) if args.model else (None, None, None)
    use_model = not resume_from
    run = api.run_pipeline(
        module if use_model else None,
        inputs if use_model else None,
        args.backend,
        backend_options=_backend_options(args.backend_option) or None,
        dynamic_shapes=dynamic_shapes,
        **given_options(args),
    )
    result = api.finish(run)

    if run.report.resumed_from:
        print(run.report.format_resume() + "\n")
    print(run.report.format_stages())
    if run.report.placement:
        print()
        print(run.report.format_placement())
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump(run.report.to_json(), f, indent=2)

    status = 0
    if isinstance(result, api.Artifact):
        if args.output:
            result.save(args.output)
            print(f"\nwrote {args.output} ({len(result.pte)} bytes)")
        if args.check:
            check = runtime.compare_with_eager(result, module, inputs, tolerance=args.tolerance)
            print(check.describe())
            status = 0 if check.passed else 1
    else:
        stage = run.report.stages[-1].stage
        if args.output and can_save(result):
            save_stage_file(args.output, result, stage, run.config)
            print(f"\nstopped after {stage}; wrote {args.output}")
        else:
            print(f"\nstopped after {stage}")
    return status


def _run(args: argparse.Namespace) -> int:
    module, inputs, _ = resolve_model(args.model)
    check = runtime.compare_with_eager(args.program, module, inputs, tolerance=args.tolerance)
    print(check.describe())
    return 0 if check.passed else 1


def _fuzz(args: argparse.Namespace) -> int:
    from compiler.fuzz import campaign, oracle

    if args.replay:
        return 1 if oracle.replay(args.replay, args.backend).kind in oracle.FAILURES else 0

    def progress(case: campaign.Case) -> None:
        stock = f" | stock: {case.stock.kind}" if case.stock else ""
        print(f"{case.number:4} {case.ours.kind}{stock}", flush=True)

    run = campaign.run(
        args.backend or "portable", args.examples, args.seed, out_dir=args.out_dir,
        with_stock=not args.no_stock, shrink=not args.no_shrink, progress=progress,
    )
    print(f"\n{run.table()}\n\n{run.details()}")
    for case in run.failures + run.shrunk:
        print(f"reproducer: {case.reproducer} ({case.ours.kind})")
    return 1 if run.failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("compiler").setLevel(logging.INFO if getattr(args, "verbose", False) else logging.WARNING)
    if args.command == "examples":
        width = max(map(len, MODELS))
        for name in MODELS:
            extra = "" if name in EXAMPLES else " (needs pip install -e '.[models]')"
            print(f"{name:{width}}  {describe(name)}{extra}")
        return 0
    try:
        return {"fuzz": _fuzz, "run": _run}.get(args.command, _compile)(args)
    except CompileError as error:
        if args.traceback:
            traceback.print_exc()
        print(f"error: {render_error(error)}", file=sys.stderr)
        return 2
