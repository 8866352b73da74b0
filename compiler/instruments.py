"""Instruments: one small hook interface around every stage.

Timing, verify-each, dumping, print-after-change and the crash reproducer are
all instruments, like MLIR's PassInstrumentation: the driver's loop only calls
the hooks. `before_stage` hooks run in registration order, `after_stage` and
`on_failure` hooks in reverse, so the first instrument registered wraps all
the others.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import tempfile
import time
from typing import Any, TextIO

from compiler.ir.artifacts import ExecutorchProgram
from compiler.ir.errors import CompileError
from compiler.ir.serialize import SUFFIX, can_save, save_stage_file

logger = logging.getLogger(__name__)


class Instrument:
    """Subclass and override the hooks you need; each default does nothing."""

    def before_stage(self, stage: str, artifact: Any) -> None:
        pass

    def after_stage(self, stage: str, before: Any, after: Any) -> None:
        pass

    def on_failure(self, stage: str, artifact: Any, error: CompileError) -> None:
        pass


class Timing(Instrument):
    """Wall time of each stage alone (register it last so it is the innermost)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._start = 0.0

    def before_stage(self, stage, artifact):
        self._start = time.perf_counter()

    def after_stage(self, stage, before, after):
        self.seconds[stage] = time.perf_counter() - self._start

    def on_failure(self, stage, artifact, error):
        self.seconds[stage] = time.perf_counter() - self._start


class VerifyEach(Instrument):
    """Checks the invariants of each stage's output type; a violation fails that stage.

    A stage that hands on the very program it was given (fold with nothing to fold,
    the dry run) is checked only for the invariants its output type adds, if that
    program was checked earlier in this run: stages never change their input in place.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._checked: list[Any] = []  # artifacts verified in this run (kept alive, so ids stay unique)

    def after_stage(self, stage, before, after):
        start = time.perf_counter()
        invariants = type(after).invariants
        program = getattr(after, "program", None)
        if program is getattr(before, "program", object()) and any(a is before for a in self._checked):
            invariants = [i for i in invariants if i not in type(before).invariants]
        try:
            for invariant in invariants:
                invariant.verify(after, stage)
            self._checked.append(after)
        finally:
            self.seconds[stage] = time.perf_counter() - start


class DumpStages(Instrument):
    """Writes `<NN>-<stage>.txt` (readable graph) and `<NN>-<stage>.stage` (resumable) per stage."""

    def __init__(self, directory: str | os.PathLike, backend: str, stage_names: tuple[str, ...]) -> None:
        self.directory = os.fspath(directory)
        self.backend = backend
        self.index = {name: i for i, name in enumerate(stage_names, start=1)}
        self.failures: list[CompileError] = []  # stage files that could not be written
        os.makedirs(self.directory, exist_ok=True)

    def path(self, stage: str, suffix: str) -> str:
        return os.path.join(self.directory, f"{self.index[stage]:02d}-{stage}{suffix}")

    def after_stage(self, stage, before, after):
        with open(self.path(stage, ".txt"), "w") as f:
            f.write(after.graph_text())
        if can_save(after):
            self._save_stage_file(stage, after)
        if isinstance(after, ExecutorchProgram):
            with open(self.path(stage, ".pte"), "wb") as f:
                f.write(after.pte)
        logger.debug("dumped %s to %s", stage, self.directory)

    def _save_stage_file(self, stage: str, artifact: Any) -> None:
        """A dump is a debugging aid: a program the serializer cannot write costs that one
        `.stage` file (the `.txt` is written), never the compile the user asked for."""
        path = self.path(stage, SUFFIX)
        try:
            save_stage_file(path, artifact, stage, self.backend)
        except Exception as exc:
            if os.path.exists(path):
                os.remove(path)  # a half-written file would only fail later, at resume
            error = CompileError(
                f"could not dump {stage}'s output as a stage file: {type(exc).__name__}: {exc}",
                stage=stage,
                hint=f"the compile goes on; {os.path.basename(self.path(stage, '.txt'))} still shows the graph. "
                "Report the serializer error with that graph",
            )
            self.failures.append(error)
            logger.warning("%s", error)


class PrintAfterChange(Instrument):
    """Prints a stage's graph only when the stage changed it."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self._before_text = ""

    def before_stage(self, stage, artifact):
        self._before_text = artifact.graph_text()

    def after_stage(self, stage, before, after):
        text = after.graph_text()
        if text != self._before_text:
            stream = self.stream or sys.stderr
            stream.write(f"// ----- after {stage} -----\n{text}\n")


class CrashReproducer(Instrument):
    """On a failure, saves the failing stage's input and attaches the command that resumes from it."""

    def __init__(
        self,
        directory: str | os.PathLike | None,
        backend: str,
        stage_names: tuple[str, ...],
        command: str = "python -m compiler compile",
    ) -> None:
        self.directory = os.fspath(directory) if directory else None
        self.backend = backend
        self.stage_names = stage_names
        self.command = command

    def on_failure(self, stage, artifact, error):
        position = self.stage_names.index(stage)
        if position == 0 or not can_save(artifact):
            return  # the input is the user's own model: nothing of theirs to lose
        produced_by = self.stage_names[position - 1]
        directory = self.directory or tempfile.mkdtemp(prefix="compiler-crash-")
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"{produced_by}{SUFFIX}")
        try:
            save_stage_file(path, artifact, produced_by, self.backend)
        except Exception:  # a reproducer must never hide the original error
            logger.exception("could not save the reproducer for stage %s", stage)
            return
        error.reproducer_path = path
        error.resume_command = (
            f"{self.command} --resume-from {shlex.quote(path)} --backend {shlex.quote(self.backend)}"
            " -o out.pte"
        )
