"""Where the CLI talks: the report on stdout; progress, our log, errors and (with -v) what
dependencies printed on stderr."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import IO, Sequence

from rich import box
from rich.console import Console
from rich.table import Table


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
        self.failed_while: str | None = None  # the step outside the stages an exception left
        self.progress: list = []  # the live progress of the stages (`instruments`)

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
        """Runs `work` under a status line with the dependencies' output captured (shown with -v);
        an exception leaving it is said to have left `doing` (the innermost step it left)."""
        try:
            with self.captured(doing), self.err.status(doing) if self.live and self.verbosity >= 0 else contextlib.nullcontext():
                return work(*args, **kwargs)
        except BaseException:
            self.failed_while = self.failed_while or doing
            raise

    @contextlib.contextmanager
    def captured(self, doing: str):
        """The dependencies' output while the block runs, kept (shown with -v), not printed."""
        from compiler.process.dependency_output import DependencyOutput

        output = DependencyOutput()
        try:
            with output:
                yield
        finally:
            self.messages.append((doing, output.leftover))

    def instruments(self) -> list:
        """The live progress of the stages, unless -q."""
        from compiler.cli.live_progress import LiveProgress

        self.progress = [LiveProgress(self.err, self.live)] if self.verbosity >= 0 else []
        return list(self.progress)

    def phase(self) -> str | None:
        """Where an exception left the command: the step outside the stages it left, else the stage
        that was running (known only while the stages' progress is shown)."""
        running = next((f"running stage {p.running}" for p in self.progress if p.running), None)
        return self.failed_while or running

    def stop_progress(self) -> None:
        for progress in self.progress:
            progress.stop()

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


def setup_logging(terminal: Terminal) -> None:
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


def print_messages(terminal: Terminal, groups: Sequence[tuple[str, Sequence[str]]]) -> None:
    """What dependencies printed, warned or logged (-v), by what was running."""
    groups = [(doing, lines) for doing, lines in [*terminal.messages, *groups] if lines]
    if not groups:
        return
    terminal.err.print("\n[bold]what dependencies printed[/] (kept off the terminal without -v):")
    for doing, lines in groups:
        terminal.err.print(f"  while {doing}:", highlight=False)
        for line in lines:
            terminal.err.print(f"    {line}", highlight=False, markup=False)
