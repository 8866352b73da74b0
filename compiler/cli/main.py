"""`python -m compiler`: a thin layer over the Python API.

The option flags are generated from `compiler.driver.config.options()` (one flag per
option, under the option's own name), so the CLI cannot offer what the API does
not. This module is the only one that prints for the user, spells options as
flags, or decides an exit code. It imports no torch when it loads: `--help`,
`examples` and a mistyped argument answer at once, and every path the user gave
is checked before the compile starts; each command imports what it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import sys
import traceback
from typing import IO, Any, Mapping, Sequence

import attrs
from rich import box
from rich.console import Console
from rich.table import Table

from compiler import backends
from compiler.cli import common, describe_image, generate, locate, transcribe
from compiler.models import catalog
from compiler.driver import config, dynamic_dims
from compiler.stages import STAGE_NAMES
from compiler.ir.errors import CompileError, UserInputError
from compiler.running.tolerance import FLOAT16_OF_LARGEST, FLOAT32_ABSOLUTE

RESUME = "python -m compiler compile --resume-from {path}"
DEFAULT_BACKEND = config.CompileConfig().backend


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m compiler", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    # What every command that works prints: -q, -v, --traceback.
    talk = argparse.ArgumentParser(add_help=False)
    loudness = talk.add_mutually_exclusive_group()
    loudness.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors (and a failed check)")
    loudness.add_argument(
        "-v", "--verbose", action="count", default=0,
        help="-v: our log at INFO and what dependencies printed; -vv: our log at DEBUG",
    )
    talk.add_argument("--traceback", action="store_true", help="show the full traceback on errors")

    compile_cmd = commands.add_parser("compile", parents=[talk], help="compile a model to an ExecuTorch .pte")
    compile_cmd.add_argument(
        "model",
        nargs="?",
        help="a built-in example (name[:key=value,...]), path/to/file.py:factory or a save_pretrained folder "
        "(with --task); optional with --resume-from unless --check",
    )
    _add_task_flag(compile_cmd)
    compile_cmd.add_argument(
        "--backend",
        choices=backends.available(),
        help=f"where the program runs (default: {DEFAULT_BACKEND}; with --resume-from: the recorded one)",
    )
    compile_cmd.add_argument(
        "--backend-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the backend's partitioner (VALUE is read as JSON, else as a string)",
    )
    compile_cmd.add_argument(
        "-o", "--output", metavar="FILE",
        help="write the .pte here (with --stop-after: the stage file); without it nothing is written",
    )
    _add_option_flags(compile_cmd)
    calibration = compile_cmd.add_mutually_exclusive_group()
    calibration.add_argument(
        "--calibration", metavar="FILE",
        help="calibration inputs for a static --quantize scheme: a torch.save'd list of input tuples",
    )
    calibration.add_argument(
        "--calibration-draws", type=int, metavar="N",
        help="calibrate on N draws of inputs from the model factory (one that takes a seed keyword, as the "
        "built-in models do)",
    )
    _add_dynamic_dim_flag(compile_cmd, "--check")
    compile_cmd.add_argument("--check", action="store_true", help="run the .pte and compare with eager PyTorch")
    _add_tolerance_flag(compile_cmd, "--check")
    locate.add_compile_flag(compile_cmd)
    compile_cmd.add_argument(
        "--report-json", metavar="FILE",
        help="write the whole report as JSON: model, backend and options, versions, stages, placement per node, check",
    )
    compile_cmd.add_argument(
        "--report-html", metavar="FILE",
        help="write the report as one self-contained HTML page, with the graph coloured by where each node runs",
    )

    run_cmd = commands.add_parser(
        "run", parents=[talk],
        help="run any .pte (ours, or one built elsewhere, e.g. by stock ExecuTorch) on a model's example "
        "inputs and compare with eager PyTorch",
    )
    run_cmd.add_argument("program", metavar="PROGRAM.pte")
    run_cmd.add_argument("model", help="the model the program was built from, as compile's MODEL")
    _add_task_flag(run_cmd)
    _add_dynamic_dim_flag(run_cmd, "the comparison")
    _add_tolerance_flag(run_cmd, "the comparison")
    run_cmd.add_argument(
        "--weights", metavar="FILE.ptd",
        help="the program's data file, when it is not beside it as PROGRAM.ptd (one share-weights wrote)",
    )

    share_cmd = commands.add_parser(
        "share-weights", parents=[talk],
        help="write one data file for several programs compiled with --external-weights: each distinct weight "
        "once; each program then runs with it (run --weights)",
    )
    share_cmd.add_argument("data_files", nargs="+", metavar="FILE", help="the programs' .ptd files (or their .pte)")
    share_cmd.add_argument("-o", "--output", required=True, metavar="SHARED.ptd", help="the data file to write")

    commands.add_parser("examples", help="list the built-in example models")

    visualize_cmd = commands.add_parser(
        "visualize", parents=[talk],
        help="open Google's Model Explorer on a .pte or a .stage file (pip install -e '.[explorer]')",
    )
    visualize_cmd.add_argument("file", metavar="FILE", help="a .pte, or a .stage file from --dump-dir / --stop-after")
    visualize_cmd.add_argument("--port", type=int, help="the Model Explorer server's port (default: a free one)")
    visualize_cmd.add_argument(
        "--no-browser", action="store_true", help="print the address instead of opening a browser"
    )

    sweep_cmd = commands.add_parser(
        "sweep", parents=[talk],
        help="compile every job of a jobs file (models x backends x options) with a process pool or on Ray",
    )
    sweep_cmd.add_argument(
        "jobs", metavar="JOBS",
        help="a .json, .toml or .yaml file: a list of jobs (or {\"jobs\": [...]}; TOML: [[jobs]]), each with "
        "model, backend, backend_options, any option of compile by its name (fold_skip_ops, ...), dynamic_dim "
        f"(a list of {dynamic_dims.FORM} or {dynamic_dims.TIED_FORM}, as --dynamic-dim), check, tolerance, "
        "output (a .pte path; {model}, {backend}, {job} are filled in); a list expands to the cross product",
    )
    sweep_cmd.add_argument(
        "--workers", type=int, metavar="N", help="worker processes (default: the CPU count, at most one per job)"
    )
    sweep_cmd.add_argument(
        "--ray", metavar="ADDRESS",
        help="run the jobs as Ray tasks on an existing cluster (ADDRESS, or auto); pip install -e '.[ray]'",
    )
    _add_option_flags(sweep_cmd, only=("cache", "cache_dir", "cache_max_mb"))

    fuzz_cmd = commands.add_parser(
        "fuzz", parents=[talk], help="compile random programs with ours and stock ExecuTorch; compare both with eager"
    )
    fuzz_cmd.add_argument(
        "--backend", choices=backends.available(),
        help=f"default: {DEFAULT_BACKEND} (with --replay: the file's backend)",
    )
    fuzz_cmd.add_argument("--examples", type=int, default=100, help="how many programs to draw")
    fuzz_cmd.add_argument("--seed", type=int, default=0, help="the same seed draws the same programs")
    fuzz_cmd.add_argument("--out-dir", default="fuzz-failures", help="where failing programs are written as reproducers")
    fuzz_cmd.add_argument("--no-stock", action="store_true", help="do not run the stock ExecuTorch path")
    fuzz_cmd.add_argument("--no-shrink", action="store_true", help="do not shrink the first failure of each kind")
    fuzz_cmd.add_argument("--replay", metavar="FILE", help="run one reproducer file instead")
    fuzz_cmd.add_argument(
        "--quantize", action="store_true",
        help="the quantize axis: programs with Linear and Embedding layers, each quantized by a random scheme the "
        "backend takes; stock compiles them with ExecuTorch's recipe for the scheme; both are compared with their "
        "eager quantized model",
    )
    generate.add_parser(commands, talk)
    transcribe.add_parser(commands, talk)
    describe_image.add_parser(commands, talk)
    locate.add_parser(commands, talk)
    return parser


def _add_tolerance_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--tolerance", type=float, default=None,
        help=f"max abs error {what} accepts (default: {FLOAT32_ABSOLUTE:g} for a program computing "
        f"in float32; {FLOAT16_OF_LARGEST:g} x the largest eager output when a delegate computes "
        "in float16)",
    )


def _add_dynamic_dim_flag(parser: argparse.ArgumentParser, check: str) -> None:
    parser.add_argument(
        "--dynamic-dim", action="append", default=[], type=_dynamic_dim, metavar=dynamic_dims.FORM,
        help=f"{dynamic_dims.HELP} ({check} also runs with every dynamic size at its MIN, then at its MAX)",
    )


def _add_option_flags(parser: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
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


class Terminal:
    """Where the CLI talks: the report on stdout, progress, logs and errors on stderr.

    The stderr stream is a duplicate of file descriptor 2 taken at start, as the compile
    points descriptor 2 elsewhere while it runs (to keep dependencies quiet). Live progress
    redraws only on a terminal without NO_COLOR; otherwise each stage is one plain line.
    """

    def __init__(self, verbosity: int) -> None:
        self.verbosity = verbosity  # -1 quiet, 0 default, 1 -v, 2 -vv
        stream = _duplicate(sys.stderr)
        self.live = stream.isatty() and "NO_COLOR" not in os.environ
        self.err = Console(file=stream, highlight=False, soft_wrap=True, no_color="NO_COLOR" in os.environ)
        # Off a terminal (a pipe, a file) table rows are never wrapped, so each stays one line to grep.
        self.out = Console(file=sys.stdout, highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 100_000)
        self.messages: list[tuple[str, tuple[str, ...]]] = []  # (while doing what, lines) captured outside stages

    def close(self) -> None:
        """Gives back our logger and closes the duplicate of stderr (main() may run many times in
        one process, e.g. in tests)."""
        logger = logging.getLogger("compiler")
        logger.handlers, logger.propagate = [], True
        logger.setLevel(logging.NOTSET)
        if self.err.file is not sys.stderr:
            self.err.file.close()

    def say(self, text: str = "") -> None:
        if self.verbosity >= 0:
            self.out.print(text, highlight=False, markup=False)

    def check(self, check) -> None:
        """A check's result is the command's answer: on stdout, and even with -q when it failed."""
        if self.verbosity >= 0 or not check.passed:
            self.out.print(check.describe(), highlight=False, markup=False)

    def quietly(self, doing: str, work, *args, **kwargs):
        """Runs `work` with the dependencies' output captured (shown with -v)."""
        from compiler.process.dependency_output import DependencyOutput

        output = DependencyOutput()
        try:
            with output, self.err.status(doing) if self.live and self.verbosity >= 0 else contextlib.nullcontext():
                return work(*args, **kwargs)
        finally:
            self.messages.append((doing, output.leftover))

    def table(self, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        if self.verbosity < 0:
            return
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
        for name in header:
            table.add_column(name, overflow="fold")
        for row in rows:
            table.add_row(*row)
        with self.out.capture() as drawn:
            self.out.print(table)
        # rich pads every cell to its column's width; trailing blanks only get in the way of a copy.
        self.out.file.write("".join(line.rstrip() + "\n" for line in drawn.get().splitlines()))


def _duplicate(stream: IO[str]) -> IO[str]:
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return stream  # not a real file (a test's capture): the compile leaves it alone
    return os.fdopen(os.dup(fd), "w", buffering=1, encoding=getattr(stream, "encoding", None), errors="replace")


def _setup_logging(terminal: Terminal) -> None:
    """Our log on stderr, at WARNING by default, INFO with -v, DEBUG with -vv, ERROR with -q."""
    from rich.logging import RichHandler

    logger = logging.getLogger("compiler")
    handler: logging.Handler
    if terminal.live:
        handler = RichHandler(console=terminal.err, show_time=False, show_path=False)
    else:
        handler = logging.StreamHandler(terminal.err.file)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.handlers = [handler]
    logger.propagate = False
    logger.setLevel({-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO}.get(terminal.verbosity, logging.DEBUG))


@contextlib.contextmanager
def _writing(flag: str, path: str, what: str, cache_dir: str | None):
    """A write after the compile that fails (a full disk, a mount gone read-only) is a named
    error that says where the work is kept."""
    try:
        yield
    except OSError as exc:
        kept = (
            f"the stage cache in {cache_dir} holds the compiled stages: fix the path or free the space and "
            "run the same command again, which loads them instead of compiling"
            if cache_dir
            else "the compile was not cached (--no-cache): fix the path or free the space and run it again"
        )
        raise UserInputError(f"{flag} {path!r}: writing {what} failed after the compile ({exc.strerror})", hint=kept) from None


def _add_task_flag(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--task", choices=catalog.TASKS,
        help="what to compile of a save_pretrained MODEL folder (optimum-executorch's task names; text-generation: "
        "the decoder step with its KV cache, as `generate` compiles it)",
    )


def _compile(args: argparse.Namespace, terminal: Terminal) -> int:
    resume_from = getattr(args, "resume_from", None)
    if args.model:
        args.model = catalog.with_task(args.model, args.task)
    if not args.model and not resume_from:
        raise UserInputError("compile needs a MODEL (or --resume-from FILE)", hint="see `python -m compiler examples`")
    if args.locate and not args.check:
        raise UserInputError("--locate locates a failed --check", hint="add --check")
    if args.check and not args.model:
        raise UserInputError("--check needs the MODEL to compare with", hint="pass MODEL along with --resume-from")
    if args.model:
        catalog.check_model_spec(args.model)
    if resume_from and not os.path.isfile(resume_from):
        raise UserInputError(f"--resume-from {resume_from!r}: the stage file does not exist", hint="give a .stage file "
                             "written by --stop-after, --dump-dir or a failed compile")
    if args.calibration and not os.path.isfile(args.calibration):
        raise UserInputError(
            f"--calibration {args.calibration!r}: the file does not exist",
            stage="quantize", hint="give a file written by torch.save([inputs, ...], FILE)",
        )
    if args.calibration_draws is not None and args.calibration_draws < 1:
        raise UserInputError(f"--calibration-draws {args.calibration_draws}: give at least 1", stage="quantize")
    if args.dynamic_dim and not args.model:
        raise UserInputError("--dynamic-dim needs the MODEL", hint="a resumed run keeps its program's dynamic sizes")
    if (args.calibration or args.calibration_draws) and not args.model:
        raise UserInputError("calibration needs the MODEL", stage="quantize", hint="pass MODEL, or drop the calibration flag")
    output = common.file_to_write("-o", args.output)
    report_json = common.file_to_write("--report-json", args.report_json)
    report_html = common.file_to_write("--report-html", args.report_html)
    given = given_options(args)
    if "dump_dir" in given:
        given["dump_dir"] = common.folder_to_write("--dump-dir", given["dump_dir"])
    if "reproducer_dir" in given:
        given["reproducer_dir"] = common.folder_to_write("--reproducer-dir", given["reproducer_dir"])
    elif "dump_dir" not in given:
        from compiler.driver.instruments import default_reproducer_dir

        given["reproducer_dir"] = default_reproducer_dir()
    if "cache_dir" in given:
        given["cache_dir"] = common.folder_to_write("--cache-dir", given["cache_dir"])
    elif given.get("cache", True):
        from compiler.driver.cache import default_cache_dir

        given["cache_dir"] = default_cache_dir()
    backend_options = common.backend_options(args.backend_option) or None
    backend = args.backend or (None if resume_from else DEFAULT_BACKEND)
    programs = None
    if args.model:
        from compiler.driver.program_cache import ProgramCache

        written = [path for path in (output, report_json, report_html) if path]
        programs = ProgramCache.for_run(args.model, backend, backend_options, given, args.dynamic_dim,
                                        args.calibration or args.calibration_draws, written)
    # A check builds and captures the model anyway (the stage cache serves the rest); the HTML
    # report draws the partitioned program, which the program cache does not keep.
    served = programs is not None and not args.check and not report_html
    result = programs.load() if served else None
    module = inputs = dynamic_shapes = calibration = None
    use_model = not resume_from
    if result is None:
        from compiler import api
        from compiler.models.examples import resolve_model
        from compiler.cli.live_progress import LiveProgress

        terminal.quietly(f"loading ExecuTorch{f' and the {backend} backend' if backend else ''}", common.load_pipeline, backend)
        if args.model:
            module, inputs, dynamic_shapes = terminal.quietly("building the model", resolve_model, args.model)
        dynamic_shapes = api.model_dynamic_shapes(args.model, module, inputs, dynamic_shapes, args.dynamic_dim)
        calibration = terminal.quietly("reading the calibration inputs", _calibration, args) if args.model else None
        instruments = [LiveProgress(terminal.err, terminal.live)] if terminal.verbosity >= 0 else []
        try:
            result = api.compile(
                module if use_model else None,
                inputs if use_model else None,
                args.backend,
                backend_options=backend_options,
                dynamic_shapes=dynamic_shapes,
                calibration=calibration,
                instruments=instruments,
                **given,
            )
        except CompileError as error:
            terminal.messages.append((f"compiling (stage {error.stage})", error.dependency_messages))
            raise
        if programs is not None and result.stopped_after == STAGE_NAMES[-1]:
            programs.store(result.program, result.report)
    report = attrs.evolve(result.report, model=args.model)

    status, check = 0, None
    cache_dir = given.get("cache_dir") if given.get("cache", True) else None
    if result.stopped_after == STAGE_NAMES[-1]:
        if output:
            with _writing("-o", output, "the program", cache_dir):
                result.save(output)
        if args.check:
            from compiler.running import runtime

            if not use_model:  # a resumed run: the check needs the eager model its program quantized
                result = terminal.quietly(
                    "quantizing the model for the check", api.with_quantized_model, result, module, inputs,
                    dynamic_shapes, calibration,
                )
            check = terminal.quietly("checking against eager", runtime.compare_with_eager, result, module, inputs,
                                     tolerance=args.tolerance)
            report = attrs.evolve(report, check=check.to_json())
            status = 0 if check.passed else 1
    elif output:
        from compiler.driver.stage_files import can_save, save_stage_file

        if can_save(result.artifact):
            with _writing("-o", output, "the stage file", cache_dir):
                save_stage_file(output, result.artifact, result.stopped_after, result.config)
        else:
            output = None

    _print_report(terminal, report)
    location = locate.after_check(args, terminal, result, module, inputs, check)
    if report_json:
        with _writing("--report-json", report_json, "the report", cache_dir), open(report_json, "w") as f:
            json.dump(report.to_json(), f, indent=2)
    if report_html:
        from compiler.reporting.html_report import render_html

        title = f"{args.model or report.resumed_from} compiled for {report.config.get('backend')}"
        page = render_html(
            report, result.stages.get("partition"), title=title, located=location.highlight() if location else None
        )
        with _writing("--report-html", report_html, "the report", cache_dir), open(report_html, "w") as f:
            f.write(page)
    _print_outcome(terminal, result, report, output, check, [p for p in (report_json, report_html) if p])
    return status


def _calibration(args: argparse.Namespace) -> Any:
    if args.calibration_draws:
        from compiler.models.examples import draw_inputs

        return draw_inputs(args.model, args.calibration_draws)
    if not args.calibration:
        return None
    import torch

    try:
        return torch.load(args.calibration, weights_only=True)
    except Exception as exc:  # torch.load fails in many ways on a file it did not write
        raise UserInputError(
            f"--calibration {args.calibration!r} is not a torch.save'd list of input tuples "
            f"({type(exc).__name__}: {exc})",
            stage="quantize", hint="write it with torch.save([(tensor, ...), ...], FILE)",
        ) from exc


def _print_report(terminal: Terminal, report) -> None:
    if report.resumed_from:
        terminal.say(report.format_resume() + "\n")
    terminal.table(*report.stage_rows())
    if report.placement:
        terminal.say("\n" + report.format_shares())
        terminal.table(*report.placement_rows())
        if report.placement_note():
            terminal.say(report.placement_note())
    if terminal.verbosity >= 1:
        _print_messages(terminal, [(f"stage {r.stage}", r.messages) for r in report.stages])


def _print_messages(terminal: Terminal, groups: Sequence[tuple[str, Sequence[str]]]) -> None:
    """What dependencies printed, warned or logged (-v), by what was running."""
    groups = [(doing, lines) for doing, lines in [*terminal.messages, *groups] if lines]
    if not groups:
        return
    terminal.err.print("\n[bold]what dependencies printed[/] (kept off the terminal without -v):")
    for doing, lines in groups:
        terminal.err.print(f"  while {doing}:", highlight=False)
        for line in lines:
            terminal.err.print(f"    {line}", highlight=False, markup=False)


def _print_outcome(terminal: Terminal, result, report, output, check, reports: Sequence[str]) -> None:
    if result.stopped_after == STAGE_NAMES[-1]:
        written = (
            f"wrote {_sizes(result.program, output)}" if output else "nothing written: give -o FILE.pte to save the program"
        )
    else:
        written = f"stopped after {result.stopped_after}; " + (f"wrote {output}" if output else "nothing written (-o FILE.stage saves it)")
    terminal.say("\n" + written)
    for path in reports:
        terminal.say(f"wrote {path}")
    if check is not None:
        terminal.check(check)


def _sizes(program, output: str) -> str:
    """The files a program was saved to, with their sizes."""
    from compiler.ir.program_data import data_file_path

    written = f"{output} ({len(program.data)} bytes)"
    if program.weights is not None:
        written += f" and its weights {data_file_path(output)} ({len(program.weights)} bytes)"
    return written


def _run(args: argparse.Namespace, terminal: Terminal) -> int:
    args.model = catalog.with_task(args.model, args.task)
    catalog.check_model_spec(args.model)
    if not os.path.isfile(args.program):
        raise UserInputError(f"PROGRAM {args.program!r} does not exist", hint="give the path of a .pte file")
    from compiler import api
    from compiler.running import runtime
    from compiler.models.examples import resolve_model

    module, inputs, own = terminal.quietly("building the model", resolve_model, args.model)
    # A .pte does not say which sizes are dynamic: the flags say so (the factory's own only with them, to
    # refuse both), and the check runs at their ends too.
    shapes = None
    if args.dynamic_dim:
        shapes = api.model_dynamic_shapes(args.model, module, inputs, own, args.dynamic_dim)
    if args.weights is not None and not os.path.isfile(args.weights):
        raise UserInputError(f"--weights {args.weights!r} does not exist", hint="give the path of a .ptd file")
    check = terminal.quietly("running the program and eager", runtime.compare_with_eager, args.program, module,
                             inputs, tolerance=args.tolerance, dynamic_shapes=shapes, weights=args.weights)
    terminal.check(check)
    if terminal.verbosity >= 1:
        _print_messages(terminal, [])
    return 0 if check.passed else 1


def _share_weights(args: argparse.Namespace, terminal: Terminal) -> int:
    from compiler.ir.shared_weights import share_weights

    shared = terminal.quietly("sharing the weights", share_weights, args.data_files, args.output)
    terminal.say(shared.describe())
    return 0


def _visualize(args: argparse.Namespace, terminal: Terminal) -> int:
    if not os.path.isfile(args.file):
        raise UserInputError(f"FILE {args.file!r} does not exist", hint="give a .pte or a .stage file")
    from compiler.tools.visualize import visualize

    visualize(args.file, port=args.port, open_browser=not args.no_browser)
    return 0


def _sweep(args: argparse.Namespace, terminal: Terminal) -> int:
    """A thin layer over `compiler.tools.sweeps.sweep`: one line per job as it finishes (stderr), the
    table (stdout), each failed job's error; exit 0 only if every job passed."""
    from compiler.tools import sweeps

    if args.workers is not None and args.workers < 1:
        raise UserInputError(f"--workers {args.workers}: needs at least 1", hint="e.g. --workers 2")
    given = given_options(args)
    cache = given.get("cache", True)
    cache_dir = None
    if cache:
        if "cache_dir" in given:
            cache_dir = common.folder_to_write("--cache-dir", given["cache_dir"])
        else:
            from compiler.driver.cache import default_cache_dir

            cache_dir = default_cache_dir()
    jobs = sweeps.expand_jobs(args.jobs)  # a bad jobs file is an error before any work
    total = len(jobs)
    done = 0

    def progress(row: sweeps.SweepRow) -> None:
        nonlocal done
        done += 1
        if terminal.verbosity >= 0:
            cells = row.cells()
            terminal.err.print(f"[{done}/{total}] {cells[0]} {row.backend}: {cells[2]} ({row.seconds:.1f} s)",
                               highlight=False, markup=False)

    where = f"on Ray at {args.ray}" if args.ray else f"with {min(args.workers or os.cpu_count() or 1, total)} worker(s)"
    if terminal.verbosity >= 0:
        terminal.err.print(f"sweep: {total} job(s) {where}" + (f", stage cache {cache_dir}" if cache_dir else ""),
                           highlight=False, markup=False)
    rows = sweeps.sweep(
        args.jobs, workers=args.workers, ray_address=args.ray, cache_dir=cache_dir, cache=cache,
        cache_max_mb=given.get("cache_max_mb"), on_result=progress,
    )
    terminal.table(sweeps.TABLE_HEADER, [row.cells() for row in rows])
    failed = [row for row in rows if not row.passed]
    for row in failed:
        text = row.error or (f"check failed: max abs error {row.check['max_abs_error']:.3g} above the tolerance "
                             f"{row.check['tolerance']:.3g}" if row.check else row.status)
        terminal.err.print(f"job {row.label}: {text}", highlight=False, markup=False)
    if terminal.verbosity >= 0:
        terminal.say(f"\n{len(rows) - len(failed)} of {len(rows)} job(s) passed")
    return 0 if not failed else 1


def _fuzz(args: argparse.Namespace, terminal: Terminal) -> int:
    from compiler.tools.fuzz import campaign, oracle

    if args.replay:
        return 1 if oracle.replay(args.replay, args.backend).kind in oracle.FAILURES else 0

    def progress(case: campaign.Case) -> None:
        stock = f" | stock: {case.stock.kind}" if case.stock else ""
        scheme = f" ({campaign.describe(case.program)})" if args.quantize else ""
        terminal.say(f"{case.number:4} {case.ours.kind}{stock}{scheme}")

    found = campaign.fuzz(
        args.backend or DEFAULT_BACKEND, args.examples, args.seed, out_dir=args.out_dir,
        with_stock=not args.no_stock, shrink=not args.no_shrink, progress=progress, quantize=args.quantize,
    )
    terminal.say(f"\n{found.table()}\n\n{found.details()}")
    for case in found.failures + found.shrunk:
        terminal.say(f"reproducer: {case.reproducer} ({case.ours.kind})")
    return 1 if found.failures else 0


def _examples(args: argparse.Namespace, terminal: Terminal) -> int:
    entries = catalog.models().values()
    width = max(len(entry.name) for entry in entries)
    for entry in entries:
        extra = " (needs pip install -e '.[models]')" if entry.needs_models_extra else ""
        terminal.say(f"{entry.name:{width}}  {entry.description}{extra}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    terminal = Terminal(-1 if getattr(args, "quiet", False) else getattr(args, "verbose", 0))
    _setup_logging(terminal)
    commands = {"compile": _compile, "run": _run, "share-weights": _share_weights, "visualize": _visualize, "sweep": _sweep, "fuzz": _fuzz, "examples": _examples, "generate": generate.run, "transcribe": transcribe.run, "describe-image": describe_image.run, "locate": locate.run}
    try:
        return commands[args.command](args, terminal)
    except CompileError as error:
        if args.traceback:
            traceback.print_exc(file=terminal.err.file)
        terminal.err.print(f"error: {render_error(error)}", highlight=False, markup=False)
        if terminal.verbosity >= 1:
            _print_messages(terminal, [])
        return 2
    finally:
        terminal.close()
