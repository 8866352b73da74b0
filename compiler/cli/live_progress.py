"""Live progress on the terminal: one line per stage, with what the running stage is doing
(the latest step reported through `compiler.reporting.progress.steps`) and, when it ends, the
memory the process holds."""

from __future__ import annotations

import contextvars
import time

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn

from compiler.driver.instruments import Instrument
from compiler.process.memory import gigabytes, peak_resident_bytes, resident_bytes
from compiler.reporting import progress


def _memory_held() -> str:
    """What the process holds after a stage, and its peak so far: a real-size compile shows where
    its memory goes as it runs."""
    held = resident_bytes()
    return "" if held is None else f"holds {gigabytes(held)} (peak so far {gigabytes(peak_resident_bytes())})"


class LiveProgress(Instrument):
    """One line per stage: a spinner while it runs, its elapsed time, its current step.

    `live=False` (output not a terminal, or NO_COLOR set) prints one plain line per stage
    when it ends instead of redrawing.
    """

    def __init__(self, console: Console, live: bool) -> None:
        self.console = console
        self.live = live
        self.stages: tuple[str, ...] = ()
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._token: contextvars.Token | None = None
        self._start = 0.0
        self.running: str | None = None  # the stage running now (None between stages)

    def before_pipeline(self, config, stages, artifact):
        self.stages = stages
        if self.live:
            self._progress = Progress(
                SpinnerColumn(finished_text="[green]✓[/]"),
                TextColumn("{task.description:<24}"),
                TextColumn("{task.elapsed:>6.2f} s"),
                TextColumn("[dim]{task.fields[step]}"),
                console=self.console,
                redirect_stdout=False,  # the compile's own capture owns sys.stdout/stderr
                redirect_stderr=False,
                transient=False,
            )
            self._progress.start()

    def before_stage(self, stage, artifact):
        self.running = stage
        self._start = time.perf_counter()
        self._token = progress.listen(self._step)
        if self._progress:
            self._task = self._progress.add_task(self._label(stage), total=None, step="")

    def _label(self, stage: str) -> str:
        return f"[{self.stages.index(stage) + 1}/{len(self.stages)}] {stage}"

    def _step(self, desc: str, done: int, total: int | None) -> None:
        if self._progress and self._task is not None:
            shown = f"{desc} {done}/{total}" if total else f"{desc} {done}"
            self._progress.update(self._task, step=shown)

    def _end_stage(self, stage: str, outcome: str) -> None:
        self.running = None
        if self._token is not None:
            progress.stop_listening(self._token)
            self._token = None
        if self._progress and self._task is not None:
            self._progress.update(self._task, total=1, completed=1, step=outcome)
            self._progress.stop_task(self._task)  # freezes its elapsed time
        elif not self.live:
            seconds = time.perf_counter() - self._start
            self.console.print(f"{self._label(stage):<24} {seconds:7.2f} s  {outcome}".rstrip(), highlight=False)

    def after_stage(self, stage, before, after):
        self._end_stage(stage, _memory_held())

    def on_failure(self, stage, artifact, error):
        self._end_stage(stage, "[red]failed[/]" if self.live else "failed")
        self.stop()

    def after_pipeline(self, result):
        self.stop()

    def stop(self) -> None:
        """Ends the live display, once: also when the run was interrupted, so the terminal gets its
        cursor back."""
        if self._progress:
            self._progress.stop()
            self._progress = None
