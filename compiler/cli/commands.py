"""The CLI's smaller commands: run, share-weights, examples, visualize, sweep and fuzz. Each
parses, calls one function of the API or the tools, and prints."""

from __future__ import annotations

import argparse
import os

from compiler import backends
from compiler.cli import common, flags
from compiler.cli.terminal import Terminal, print_messages
from compiler.driver import dynamic_dims
from compiler.ir.errors import UserInputError
from compiler.models import catalog


def add_parsers(commands, talk: argparse.ArgumentParser) -> None:
    run_cmd = commands.add_parser(
        "run", parents=[talk],
        help="run any .pte (ours, or one built elsewhere, e.g. by stock ExecuTorch) on a model's example "
        "inputs and compare with eager PyTorch",
    )
    run_cmd.add_argument("program", metavar="PROGRAM.pte")
    run_cmd.add_argument("model", help="the model the program was built from, as compile's MODEL")
    flags.add_task_flag(run_cmd)
    flags.add_dynamic_dim_flag(run_cmd, "the comparison")
    flags.add_tolerance_flag(run_cmd, "the comparison")
    flags.add_calibration_flags(run_cmd, "the static quantize scheme the program records (those its compile took)")
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
    flags.add_option_flags(sweep_cmd, only=("cache", "cache_dir", "cache_max_mb"))

    fuzz_cmd = commands.add_parser(
        "fuzz", parents=[talk], help="compile random programs with ours and stock ExecuTorch; compare both with eager"
    )
    fuzz_cmd.add_argument(
        "--backend", choices=backends.available(),
        help=f"default: {flags.DEFAULT_BACKEND} (with --replay: the file's backend)",
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
    flags.add_check_nodes_flag(fuzz_cmd, "each program whose outputs pass")
    fuzz_cmd.add_argument(
        "--model-sizes", action="store_true",
        help="draw widths and sequence lengths up to a 1B model's (hidden 2048, 512 tokens) instead of a few "
        "elements: sums over long rows, normalizations, attention and matrix products at the sizes models have",
    )


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
    from compiler.tools.compile_job import calibration_inputs

    calibration = terminal.quietly("reading the calibration inputs", calibration_inputs, args.model, args.calibration,
                                   args.calibration_draws)
    # Compared as its compile's check compared it: with the model quantized by the configuration it records.
    reference = terminal.quietly("quantizing the model as the program records", api.program_reference, args.program,
                                 module, inputs, shapes, calibration)
    check = terminal.quietly("running the program and eager", runtime.compare_with_eager, args.program, module,
                             inputs, tolerance=args.tolerance, dynamic_shapes=shapes, weights=args.weights,
                             reference=reference)
    terminal.check(check)
    if terminal.verbosity >= 1:
        print_messages(terminal, [])
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
    given = flags.given_options(args)
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
    from compiler.tools.fuzz import campaign, oracle, programs

    if args.replay:
        return 1 if oracle.replay(args.replay, args.backend).kind in oracle.FAILURES else 0

    def progress(case: campaign.Case) -> None:
        stock = f" | stock: {case.stock.kind}" if case.stock else ""
        scheme = f" ({campaign.describe(case.program)})" if args.quantize else ""
        terminal.say(f"{case.number:4} {case.ours.kind}{stock}{scheme}")

    found = campaign.fuzz(
        args.backend or flags.DEFAULT_BACKEND, args.examples, args.seed, out_dir=args.out_dir,
        with_stock=not args.no_stock, shrink=not args.no_shrink, progress=progress, quantize=args.quantize,
        check_nodes=args.check_nodes, sizes=programs.MODEL if args.model_sizes else programs.SMALL,
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




RUNS = {
    "run": _run, "share-weights": _share_weights, "visualize": _visualize, "sweep": _sweep, "fuzz": _fuzz,
    "examples": _examples,
}
