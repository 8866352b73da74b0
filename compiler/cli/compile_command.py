"""`python -m compiler compile MODEL`: the flags of `compiler.tools.compile_job.compile_job`, and
what it did, printed: the stage table, the placement, the files written and the check."""

from __future__ import annotations

import argparse

from compiler.cli import common, flags
from compiler.stages import STAGE_NAMES

# The job's files, as the flags that name them in its errors.
PLACES = {"output": "-o", "report_json": "--report-json", "report_html": "--report-html"}


def add_parser(commands, talk: argparse.ArgumentParser) -> None:
    command = commands.add_parser(
        "compile", parents=[talk, flags.backend_flags("; with --resume-from: the recorded one")],
        help="compile a model to an ExecuTorch .pte",
    )
    command.add_argument(
        "model", nargs="?",
        help="a built-in example (name[:key=value,...]), path/to/file.py:factory or a save_pretrained folder "
        "(with --task); optional with --resume-from unless --check",
    )
    flags.add_task_flag(command)
    command.add_argument(
        "-o", "--output", metavar="FILE",
        help="write the .pte here (with --stop-after: the stage file); without it nothing is written",
    )
    flags.add_option_flags(command)
    flags.add_calibration_flags(command, "a static --quantize scheme")
    flags.add_dynamic_dim_flag(command, "--check")
    command.add_argument("--check", action="store_true", help="run the .pte and compare with eager PyTorch")
    flags.add_tolerance_flag(command, "--check")
    command.add_argument(
        "--locate", action="store_true",
        help="with --check: when the check fails, name the first stage and node whose outputs leave eager's",
    )
    flags.add_check_nodes_flag(command, "the program")
    command.add_argument(
        "--report-json", metavar="FILE",
        help="write the whole report as JSON: model, backend and options, versions, stages, placement per node, check",
    )
    command.add_argument(
        "--report-html", metavar="FILE",
        help="write the report as one self-contained HTML page, with the graph coloured by where each node runs",
    )


def run(args: argparse.Namespace, terminal) -> int:
    from compiler.models import catalog
    from compiler.tools.compile_job import compile_job

    given = flags.given_options(args)
    for name, flag in (("dump_dir", "--dump-dir"), ("reproducer_dir", "--reproducer-dir"), ("cache_dir", "--cache-dir")):
        if name in given:
            given[name] = common.folder_to_write(flag, given[name])
    job = compile_job(
        catalog.with_task(args.model, args.task) if args.model else None, args.backend,
        backend_options=common.backend_options(args.backend_option) or None, dynamic_dim=args.dynamic_dim,
        calibration_file=args.calibration, calibration_draws=args.calibration_draws,
        output=common.file_to_write("-o", args.output), report_json=common.file_to_write("--report-json", args.report_json),
        report_html=common.file_to_write("--report-html", args.report_html), check=args.check, tolerance=args.tolerance,
        locate=args.locate, check_nodes=args.check_nodes, instruments=terminal.instruments(), quietly=terminal.quietly, places=PLACES, **given,
    )
    print_report(terminal, job.report)
    if job.location is not None:
        print_location(terminal, job.location)
    _print_outcome(terminal, job)
    return 0 if job.passed else 1


def print_report(terminal, report) -> None:
    if report.resumed_from:
        terminal.say(report.format_resume() + "\n")
    terminal.table(*report.stage_rows())
    if report.placement:
        terminal.say("\n" + report.format_shares())
        terminal.table(*report.placement_rows())
        if report.placement_note():
            terminal.say(report.placement_note())
    if terminal.verbosity >= 1:
        from compiler.cli.terminal import print_messages

        print_messages(terminal, [(f"stage {r.stage}", r.messages) for r in report.stages])


def print_location(terminal, location) -> None:
    """The stage table of a location, then its finding (even with -q when something diverges)."""
    terminal.table(*location.stage_rows())
    if terminal.verbosity >= 0 or location.found:
        text = location.describe()
        if not location.found and location.note:  # describe says only that the outputs agree
            text += "\n" + location.note
        terminal.out.print("\n" + text, highlight=False, markup=False)


def _print_outcome(terminal, job) -> None:
    result, output = job.result, job.output
    if result.stopped_after == STAGE_NAMES[-1]:
        written = f"wrote {_sizes(result.program, output)}" if output else "nothing written: give -o FILE.pte to save the program"
    else:
        written = f"stopped after {result.stopped_after}; " + (f"wrote {output}" if output else "nothing written (-o FILE.stage saves it)")
    terminal.say("\n" + written)
    for path in job.reports:
        terminal.say(f"wrote {path}")
    if job.check is not None:
        terminal.check(job.check)
    if job.nodes is not None:
        terminal.out.print(job.nodes.describe(), highlight=False, markup=False)


def _sizes(program, output: str) -> str:
    """The files a program was saved to, with their sizes."""
    from compiler.ir.program_data import data_file_path

    written = f"{output} ({len(program.data)} bytes)"
    if program.weights is not None:
        written += f" and its weights {data_file_path(output)} ({len(program.weights)} bytes)"
    return written

