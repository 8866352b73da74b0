"""`python -m compiler`: a thin layer over the Python API.

Each command parses its flags, calls one function of the API (or of `compiler.tools`) and
prints what it returns. The option flags are generated from `compiler.driver.config.options()`
(one flag per option, under the option's own name), so the CLI cannot offer what the API does
not. The CLI is the only part that prints for the user, spells options as flags, or decides an
exit code. It imports no torch when it loads: `--help`, `examples` and a mistyped argument
answer at once, and every path the user gave is checked before the work starts; each command
imports what it runs.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import NoReturn, Sequence

from compiler.cli import commands, compile_command, jobs, locate
from compiler.cli.flags import render_error
from compiler.cli.terminal import Terminal, print_messages, setup_logging
from compiler.ir.errors import CompileError

__all__ = ["main", "render_error"]


class _Parser(argparse.ArgumentParser):
    """A mistyped argument is one line that names it and its choices, and where the usage is."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"error: {message}\n  see: {self.prog} --help\n")
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m compiler", description=__doc__.splitlines()[0])
    subcommands = parser.add_subparsers(dest="command", required=True)
    # What every command that works prints: -q, -v, --traceback.
    talk = argparse.ArgumentParser(add_help=False)
    loudness = talk.add_mutually_exclusive_group()
    loudness.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors (and a failed check)")
    loudness.add_argument(
        "-v", "--verbose", action="count", default=0,
        help="-v: our log at INFO and what dependencies printed; -vv: our log at DEBUG",
    )
    talk.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    compile_command.add_parser(subcommands, talk)
    commands.add_parsers(subcommands, talk)
    jobs.add_parsers(subcommands, talk)
    locate.add_parser(subcommands, talk)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    terminal = Terminal(-1 if getattr(args, "quiet", False) else getattr(args, "verbose", 0))
    setup_logging(terminal)
    runs = {"compile": compile_command.run, "locate": locate.run, **commands.RUNS,
            **{name: jobs.run for name in jobs.COMMANDS}}
    try:
        return runs[args.command](args, terminal)
    except CompileError as error:
        if args.traceback:
            traceback.print_exc(file=terminal.err.file)
        terminal.err.print(f"error: {render_error(error)}", highlight=False, markup=False)
        if terminal.verbosity >= 1:
            stage = [(f"compiling (stage {error.stage})", error.dependency_messages)] if error.stage else []
            print_messages(terminal, stage)
        return 2
    except KeyboardInterrupt:
        terminal.stop_progress()
        terminal.err.print(f"interrupted while {_phase(terminal, args)}", highlight=False, markup=False)
        return 130
    except Exception as crash:  # a bug (ours or a dependency's), not a failed check: one line, exit 2
        terminal.stop_progress()
        if args.traceback:
            traceback.print_exc(file=terminal.err.file)
        terminal.err.print(f"error: {_crash_line(crash, _phase(terminal, args), args.traceback)}", highlight=False,
                           markup=False)
        return 2
    finally:
        terminal.close()


def _phase(terminal: Terminal, args: argparse.Namespace) -> str:
    """What the command was doing when an exception left it: the step it left, else the command."""
    return terminal.phase() or f"running {args.command}"


def _crash_line(crash: Exception, phase: str, traced: bool) -> str:
    """A crash as one line: where, the exception and its message's first line."""
    message = str(crash).strip().splitlines()
    where = "" if traced else " (--traceback shows where)"
    return f"crashed while {phase}: {type(crash).__name__}{': ' + message[0] if message else ''}{where}"
