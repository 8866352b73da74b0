"""Instruments: one small hook interface around the pipeline and every stage.

Timing, verify-each, node counts, dumping, print-after-change and the crash
reproducer are all instruments, like MLIR's PassInstrumentation: the driver's
loop only calls the hooks, and builds each stage's report row from what the
instruments `record`. `before_*` hooks run in registration order, `after_*` and
`on_failure` hooks in reverse, so the first instrument registered wraps all the
others.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Mapping, TextIO

from compiler.driver.config import CompileConfig, DriverOptions, dependency_versions
from compiler.ir.errors import CompileError, VerificationError
from compiler.process.memory import PeakSampler, resident_bytes
from compiler.stages import STAGE_NAMES

# The stage-file serializer (and with it ExecuTorch) is imported on first use, inside the
# hooks that write files: the CLI builds its instruments before the compile captures
# ExecuTorch's import-time output.

if TYPE_CHECKING:
    from compiler.process.dependency_output import DependencyOutput

logger = logging.getLogger(__name__)


class Instrument:
    """Subclass and override the hooks you need; each default does nothing."""

    def before_pipeline(self, config: CompileConfig, stages: tuple[str, ...], artifact: Any) -> None:
        """`stages`: the names of the pipeline's stages, in order (also those a resume skips)."""

    def before_stage(self, stage: str, artifact: Any) -> None:
        pass

    def after_stage(self, stage: str, before: Any, after: Any) -> None:
        pass

    def on_failure(self, stage: str, artifact: Any, error: CompileError) -> None:
        pass

    def after_pipeline(self, result: Any) -> None:
        pass

    def record(self, stage: str) -> Mapping[str, Any]:
        """What this instrument has for `stage`'s row of the report: fields of
        `StageRecord` (`seconds`, `nodes_out`, ...); any other key lands in its notes."""
        return {}


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

    def record(self, stage):
        return {"seconds": self.seconds.get(stage, 0.0)}


class ResidentMemory(Instrument):
    """What the process holds after each stage and the peak it reached during it, so a real-size
    compile shows which stage costs memory (a stage cannot be made to give back what a dependency
    keeps; it can be seen)."""

    def __init__(self) -> None:
        self.held: dict[str, int | None] = {}
        self.peaks: dict[str, int | None] = {}
        self.anonymous_peaks: dict[str, int | None] = {}
        self._sampler: PeakSampler | None = None

    def before_stage(self, stage, artifact):
        self._sampler = PeakSampler()
        self._sampler.start()

    def _end(self, stage: str) -> None:
        if self._sampler is not None:
            self.peaks[stage] = self._sampler.stop()
            self.anonymous_peaks[stage] = self._sampler.anonymous_peak
            self.held[stage] = resident_bytes()
            self._sampler = None

    def after_stage(self, stage, before, after):
        self._end(stage)

    def on_failure(self, stage, artifact, error):
        self._end(stage)

    def record(self, stage):
        if stage not in self.held:
            return {}
        return {"rss_bytes": self.held[stage], "peak_rss_bytes": self.peaks[stage],
                "peak_anonymous_bytes": self.anonymous_peaks[stage]}


class CountNodes(Instrument):
    """Node, delegate and CPU-op counts of each stage's input and output."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int | None]] = {}
        self._last: tuple[Any, Any] = (None, None)  # the last output and its stats: the next input

    def after_stage(self, stage, before, after):
        old = self._last[1] if before is self._last[0] else _stats(before)
        new = _stats(after)
        self._last = (after, new)
        self.counts[stage] = {
            "nodes_in": old.nodes if old else None,
            "nodes_out": new.nodes if new else None,
            "delegates": new.delegates if new else None,
            "cpu_ops": new.cpu_ops if new else None,
        }

    def record(self, stage):
        return self.counts.get(stage, {})


def _stats(artifact: Any):
    stats = getattr(artifact, "stats", None)
    return stats() if stats else None


class VerifyEach(Instrument):
    """Checks the invariants of each stage's output type; a violation fails that stage.

    A stage that hands on the very program it was given (fold with nothing to fold,
    the dry run) is checked only for the invariants its output type adds, if that
    program was checked earlier in this run: stages never change their input in place,
    which is checked too (`stage_input_kept`). An invariant with a `key` is not checked
    again on an artifact whose key one that passed in this run had. In a program of several
    methods, state another method writes that a stage's input read at run time must still be
    read so by its output (`program_state_read`).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._checked: list[Any] = []  # artifacts verified in this run (kept alive, so ids stay unique)
        self._input: dict[str, tuple] | None = None
        self._passed: set[tuple[str, Any]] = set()  # (invariant, key) of keyed checks passed
        self._state: frozenset[str] = frozenset()  # buffers another method writes
        self._state_read: frozenset[str] | None = None  # those the stage's input reads at run time

    def before_pipeline(self, config, stages, artifact):
        self._state = config.program_state

    def before_stage(self, stage, artifact):
        from compiler.ir import invariants as inv

        start = time.perf_counter()
        self._input = inv.program_fingerprint(artifact)
        self._state_read = inv.state_read(artifact, self._state)
        self.seconds[stage] = time.perf_counter() - start

    def after_stage(self, stage, before, after):
        from compiler.ir import invariants as inv

        start = time.perf_counter() - self.seconds.get(stage, 0.0)
        violation = inv.stage_input_kept(self._input, before)
        if violation is not None:
            raise VerificationError(inv.STAGE_INPUT_KEPT, violation.reason, stage=stage, hint=inv.STAGE_INPUT_KEPT_HINT)
        violation = inv.program_state_still_read(self._state_read, after, self._state)
        if violation is not None:
            raise VerificationError(
                inv.PROGRAM_STATE_READ, violation.reason, stage=stage, nodes=violation.nodes, hint=inv.PROGRAM_STATE_READ_HINT
            )
        invariants = type(after).invariants
        program = getattr(after, "program", None)
        if program is getattr(before, "program", object()) and any(a is before for a in self._checked):
            invariants = [i for i in invariants if i not in type(before).invariants]
        try:
            for invariant in invariants:
                key = (invariant.name, invariant.key(after)) if invariant.key else None
                if key in self._passed:
                    continue
                invariant.verify(after, stage)
                if key:
                    self._passed.add(key)
            self._checked.append(after)
        finally:
            self.seconds[stage] = time.perf_counter() - start

    def record(self, stage):
        return {"verify_seconds": self.seconds.get(stage, 0.0)}


class DumpStages(Instrument):
    """Writes `<NN>-<stage>.txt` (readable graph) and `<NN>-<stage>.stage` (resumable) per stage,
    and `config.json`: the run's configuration and dependency versions (which every stage
    file records too)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        self.index: dict[str, int] = {}
        self.failures: list[CompileError] = []  # stage files that could not be written
        self.config: CompileConfig | None = None
        os.makedirs(self.directory, exist_ok=True)

    def before_pipeline(self, config, stages, artifact):
        self.config = config
        # A stage of the table keeps its number when a run starts later (the emit of several methods).
        self.index = {name: (STAGE_NAMES.index(name) if name in STAGE_NAMES else i) + 1 for i, name in enumerate(stages)}
        with open(os.path.join(self.directory, "config.json"), "w") as f:
            json.dump({"config": config.to_json(), "versions": dependency_versions()}, f, indent=2)

    def path(self, stage: str, suffix: str) -> str:
        return os.path.join(self.directory, f"{self.index[stage]:02d}-{stage}{suffix}")

    def after_stage(self, stage, before, after):
        from compiler.ir.artifacts import ExecutorchProgram
        from compiler.driver.stage_files import can_save

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
        from compiler.driver.stage_files import SUFFIX, save_stage_file

        path = self.path(stage, SUFFIX)
        try:
            save_stage_file(path, artifact, stage, self.config)
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


# Each failed compile adds a folder to the cache folder: only this many, the newest, are kept.
KEPT_REPRODUCERS = 20

# A reproducer folder in the cache folder: `<UTC timestamp>-<failing stage>-<random>`; the fixed-width
# timestamp makes name order the order they were saved in.
_CACHED_FOLDER = re.compile(r"\d{8}T\d{6}\.\d{6}Z-")


def user_cache_folder(name: str) -> str:
    """`$XDG_CACHE_HOME/staged-compiler/<name>`, else `~/.cache/staged-compiler/<name>`: the
    user's cache folder on every platform (the reproducers', the stage cache's)."""
    cache = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):  # the XDG spec: a relative path is invalid and ignored
        cache = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "staged-compiler", name)


def default_reproducer_dir() -> str:
    """The user's cache folder for reproducers, on every platform: `$XDG_CACHE_HOME/staged-compiler/
    reproducers`, else `~/.cache/staged-compiler/reproducers`. Nothing is saved there unless it is
    passed as `reproducer_dir` (the CLI does); there each failure gets its own folder, and only the
    newest `KEPT_REPRODUCERS` stay."""
    return user_cache_folder("reproducers")


class CrashReproducer(Instrument):
    """On a failure, saves the failing stage's input (with the run's configuration, so the
    file alone replays the run) and names it on the error.

    A folder the caller named gets `<stage that made it>.stage` itself, and nothing there is
    ever removed; the cache folder (`default_reproducer_dir()`) is ours to manage, so repeated
    failures there cannot pile up."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        self.in_cache = os.path.realpath(self.directory) == os.path.realpath(default_reproducer_dir())
        self.config: CompileConfig | None = None
        self.stages: tuple[str, ...] = ()

    def before_pipeline(self, config, stages, artifact):
        self.config, self.stages = config, stages

    def on_failure(self, stage, artifact, error):
        from compiler.driver.stage_files import can_save

        position = self.stages.index(stage)
        if position == 0 or not can_save(artifact):
            return  # the input is the user's own model: nothing of theirs to lose
        try:
            error.reproducer_path = self._save(stage, self.stages[position - 1], artifact)
        except Exception:  # a reproducer must never hide the original error
            logger.exception("could not save the reproducer for stage %s", stage)
        if self.in_cache:
            _keep_newest(self.directory, KEPT_REPRODUCERS)

    def _save(self, stage: str, produced_by: str, artifact: Any) -> str:
        from compiler.driver.stage_files import SUFFIX, save_stage_file

        os.makedirs(self.directory, exist_ok=True)
        if self.in_cache:
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
            folder = tempfile.mkdtemp(prefix=f"{stamp}-{stage}-", dir=self.directory)
        else:
            folder = self.directory
        path = os.path.join(folder, f"{produced_by}{SUFFIX}")
        try:
            save_stage_file(path, artifact, produced_by, self.config)
        except Exception:  # a half-written file would only fail later, at resume
            if self.in_cache:
                shutil.rmtree(folder, ignore_errors=True)
            elif os.path.exists(path):
                os.remove(path)
            raise
        return path


def _keep_newest(directory: str, count: int) -> None:
    """Removes all but the newest `count` reproducer folders. Other processes may be pruning
    the same folder at once: one already gone is fine, and anything else only costs a warning."""
    try:
        folders = sorted(name for name in os.listdir(directory) if _CACHED_FOLDER.match(name))
    except OSError as exc:
        logger.warning("could not list the reproducer folder %s: %s", directory, exc)
        return
    for name in folders[:-count]:
        try:
            shutil.rmtree(os.path.join(directory, name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not remove the old reproducer %s: %s", name, exc)


class StageMessages(Instrument):
    """Files what dependencies printed under the stage that ran while it was written (registered
    first, its hooks run last, so a stage's row also holds what the other instruments' hooks set
    off, e.g. an import during verification); a failure carries what its stage printed."""

    def __init__(self, output: "DependencyOutput") -> None:
        self.output = output
        self.messages: dict[str, tuple[str, ...]] = {}

    def after_stage(self, stage, before, after):
        self.messages[stage] = self.output.take()

    def on_failure(self, stage, artifact, error):
        error.dependency_messages = self.output.take()

    def record(self, stage):
        return {"messages": self.messages.get(stage, ())}


def instruments_for(run: DriverOptions) -> list[Instrument]:
    """The instruments a run's options ask for, outermost first: the reproducer wraps
    everything, timing is innermost so it times the stage alone."""
    instruments: list[Instrument] = []
    reproducer_dir = run.reproducer_dir or run.dump_dir
    if run.reproducer and reproducer_dir:
        instruments.append(CrashReproducer(os.path.expanduser(reproducer_dir)))
    instruments.extend(run.instruments)
    if run.dump_dir:
        instruments.append(DumpStages(os.path.expanduser(run.dump_dir)))
    if run.print_after_change:
        instruments.append(PrintAfterChange(None if run.print_after_change is True else run.print_after_change))
    instruments.append(CountNodes())
    if run.verify:
        instruments.append(VerifyEach())
    # Inside verification (its copies are the stage's) and outside timing (the sampler's start is not).
    instruments.append(ResidentMemory())
    instruments.append(Timing())
    return instruments
