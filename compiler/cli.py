"""`python -m compiler`: a thin layer over the Python API.

Every flag maps to an API option (see `driver_options`); this module is the
only one that prints for the user or decides an exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from typing import Any, Sequence

from compiler import api, backends
from compiler.examples import EXAMPLES, MODELS, describe, resolve_model
from compiler.ir.errors import CompileError, UserInputError
from compiler.ir.serialize import save_stage_file, can_save
from compiler.runtime import compare_with_eager
from compiler.stages import STAGE_NAMES


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
    compile_cmd.add_argument("--backend", default="portable", help=f"one of {', '.join(backends.available())}")
    compile_cmd.add_argument(
        "--backend-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the backend's partitioner (VALUE is read as JSON, else as a string)",
    )
    compile_cmd.add_argument("-o", "--output", help="write the .pte here (with --stop-after: the stage file)")
    compile_cmd.add_argument("--dump-dir", help="write each stage's graph and resumable stage file here")
    compile_cmd.add_argument("--print-after-change", action="store_true", help="print a stage's graph when it changed it")
    compile_cmd.add_argument("--stop-after", choices=STAGE_NAMES, help="stop after this stage")
    compile_cmd.add_argument("--resume-from", metavar="FILE", help="continue from a dumped .stage file")
    compile_cmd.add_argument("--no-verify", action="store_true", help="do not check invariants after each stage")
    compile_cmd.add_argument(
        "--fold-skip-op", action="append", default=[], metavar="OP",
        help="an op the fold stage must not fold (e.g. aten.t.default), added to its defaults",
    )
    compile_cmd.add_argument(
        "--fold-replace-skip-ops", action="store_true", help="--fold-skip-op replaces the defaults"
    )
    compile_cmd.add_argument("--reproducer-dir", help="where a failing stage's input is saved (default: dump dir or a temp dir)")
    compile_cmd.add_argument("--check", action="store_true", help="run the .pte and compare with eager PyTorch")
    compile_cmd.add_argument("--tolerance", type=float, default=1e-4, help="max abs error --check accepts")
    compile_cmd.add_argument("--report-json", metavar="FILE", help="also write the report as JSON")
    compile_cmd.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    compile_cmd.add_argument("-v", "--verbose", action="store_true", help="log what the stages do")

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


def driver_options(args: argparse.Namespace) -> dict[str, Any]:
    """The API's driver options, from the parsed flags (one flag, one option)."""
    return {
        "verify": not args.no_verify,
        "dump_dir": args.dump_dir,
        "print_after_change": sys.stdout if args.print_after_change else False,
        "stop_after": args.stop_after,
        "resume_from": args.resume_from,
        "reproducer_dir": args.reproducer_dir,
        "fold_skip_ops": args.fold_skip_op,
        "fold_replace_skip_ops": args.fold_replace_skip_ops,
    }


def _compile(args: argparse.Namespace) -> int:
    if not args.model and not args.resume_from:
        raise UserInputError("compile needs a MODEL (or --resume-from FILE)", hint="see `python -m compiler examples`")
    if args.check and not args.model:
        raise UserInputError("--check needs the MODEL to compare with", hint="pass MODEL along with --resume-from")
    module, inputs, dynamic_shapes = resolve_model(args.model) if args.model else (None, None, None)
    use_model = not args.resume_from
    run = api.run_pipeline(
        module if use_model else None,
        inputs if use_model else None,
        args.backend,
        backend_options=_backend_options(args.backend_option),
        dynamic_shapes=dynamic_shapes,
        **driver_options(args),
    )
    result = api.finish(run)

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
            check = compare_with_eager(result, module, inputs)
            ok = check.within(args.tolerance)
            print(
                f"check: {check.outputs} output(s), max abs error {check.max_abs_error:.3g}, "
                f"max rel error {check.max_rel_error:.3g} -> {'OK' if ok else 'MISMATCH'} "
                f"(tolerance {args.tolerance:g})"
            )
            status = 0 if ok else 1
    else:
        stage = run.report.stages[-1].stage
        if args.output and can_save(result):
            save_stage_file(args.output, result, stage, args.backend)
            print(f"\nstopped after {stage}; wrote {args.output}")
        else:
            print(f"\nstopped after {stage}")
    return status


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
        return _fuzz(args) if args.command == "fuzz" else _compile(args)
    except CompileError as error:
        if args.traceback:
            traceback.print_exc()
        print(f"error: {error}", file=sys.stderr)
        return 2
