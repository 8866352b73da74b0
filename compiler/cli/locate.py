"""`python -m compiler locate MODEL --backend B`: compile, then name the first stage and the first
node whose numbers leave eager's, with the chain of errors from the inputs to it; and
with `--program FILE.pte`, no compile: the given `.pte` (built elsewhere) is located against MODEL
(`compiler.locate_program`).

Loads no torch until the command runs (`compiler.cli.main` builds every parser at start).
"""

from __future__ import annotations

import argparse
import json

from compiler.cli import common, flags
from compiler.cli.compile_command import print_location


def add_parser(commands, talk: argparse.ArgumentParser) -> None:
    command = commands.add_parser(
        "locate", parents=[talk, flags.backend_flags()],
        help="compile MODEL and name the first stage and node whose outputs leave eager's (inside delegates too)",
    )
    command.add_argument("model", help="a built-in example (name[:key=value,...]) or path/to/file.py:factory")
    flags.add_tolerance_flag(command, "a stage's outputs")
    command.add_argument(
        "--report-html", metavar="FILE", help="write the compile report with the diverging node highlighted on the graph",
    )
    command.add_argument("--report-json", metavar="FILE", help="write what locate found as JSON")
    command.add_argument(
        "--program", metavar="FILE.pte",
        help="locate this .pte (built elsewhere, e.g. by stock ExecuTorch) against MODEL, without compiling",
    )


def run(args: argparse.Namespace, terminal) -> int:
    """Exit 1 when a stage diverges (as a failed check), 0 when every stage agrees."""
    from compiler.models import catalog

    catalog.check_model_spec(args.model)
    if getattr(args, "program", None):
        return _run_program(args, terminal)
    html = common.file_to_write("--report-html", args.report_html)
    as_json = common.file_to_write("--report-json", args.report_json)
    from compiler.tools.compile_job import html_page, load_pipeline

    terminal.quietly(f"loading ExecuTorch and the {args.backend} backend", load_pipeline, args.backend)
    from compiler import api
    from compiler.models.examples import resolve_model
    from compiler.tools.locate import locate_result

    module, inputs, dynamic_shapes = terminal.quietly("building the model", resolve_model, args.model)
    result = api.compile(
        module, inputs, args.backend, backend_options=common.backend_options(args.backend_option) or None,
        dynamic_shapes=dynamic_shapes, instruments=terminal.instruments(), cache=False, reproducer=False,
    )
    location = terminal.quietly("locating where the outputs diverge", locate_result, result, module, inputs,
                                tolerance=args.tolerance)
    print_location(terminal, location)
    if as_json:
        with open(as_json, "w") as f:
            json.dump(location.to_json(), f, indent=2)
        terminal.say(f"wrote {as_json}")
    if html:
        with open(html, "w") as f:
            f.write(html_page(result.report, result, f"{args.model} compiled for {args.backend}", location))
        terminal.say(f"wrote {html}")
    return 1 if location.found else 0


def _run_program(args: argparse.Namespace, terminal) -> int:
    """`locate MODEL --program FILE.pte`: exit 1 when the program's outputs leave eager's."""
    import os

    from compiler.ir.errors import UserInputError
    from compiler.models.examples import resolve_model

    if args.report_html:
        raise UserInputError("--report-html draws the compile report's graph, and a --program was not compiled here",
                             hint="use --report-json, or locate the model compiled here (without --program)")
    if args.backend_option:
        raise UserInputError("--backend-option sets a compile's backend, and a --program is not compiled here",
                             hint="leave it out: the .pte's delegates are read from the file")
    if not os.path.isfile(args.program):
        raise UserInputError(f"--program {args.program!r} is not a file", hint="give the path of a .pte")
    as_json = common.file_to_write("--report-json", args.report_json)
    from compiler.tools.compile_job import load_pipeline

    terminal.quietly("loading ExecuTorch", load_pipeline, None)
    from compiler.tools.locate import locate_program

    module, inputs, _ = terminal.quietly("building the model", resolve_model, args.model)
    location = terminal.quietly(f"locating where {args.program}'s outputs diverge", locate_program,
                                args.program, module, inputs)
    print_location(terminal, location)
    if as_json:
        with open(as_json, "w") as f:
            json.dump(location.to_json(), f, indent=2)
        terminal.say(f"wrote {as_json}")
    return 1 if location.found else 0
