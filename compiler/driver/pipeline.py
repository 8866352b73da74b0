"""Builds a pipeline of typed stages and runs it with instruments around each stage.

The loop is IREE's: skip the stages before the resume point, run each stage
between before/after hooks with its own options, return at `stop_after`. With a
stage cache, the loop asks it before each stage after capture whether the stage
must run (as TVM's `should_run`); a stage it holds is skipped. It
knows no instrument by type: each stage's report row is what the instruments
recorded for it, plus the numbers the stage itself reported.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Mapping, Sequence

import attrs

from compiler.backends.base import Backend
from compiler.driver.cache import CacheRun, StageCache
from compiler.process.collector import scans_only_new_objects
from compiler.ir.private_api import decomposable_ops_listed_once, nonzero_laid_out_by_row
from compiler.driver.config import CompileConfig
from compiler.driver.instruments import Instrument
from compiler.ir.errors import CompileError, PipelineError, ResumeError, StageFailure
from compiler.ir.mapped import release_mapped_pages
from compiler.reporting.report import Report, StageRecord, plain_phrase
from compiler.stages.base import Stage, StageContext

logger = logging.getLogger(__name__)

# torch.export, ExecuTorch's passes and coremltools keep process-wide tracing state (torch's
# proxy-mode slot, coremltools' MIL builder context): two stages tracing at once in two
# threads corrupt each other. One stage runs at a time per process; compiles in threads
# take turns stage by stage (for parallel compiles use processes).
_ONE_STAGE_AT_A_TIME = threading.RLock()

# The stage whose output keys the stage cache: the program as captured (the model quantized
# before it, if asked) says what every later stage is given.
KEYED_BY = "capture"


@attrs.frozen
class PipelineResult:
    artifact: Any  # the artifact of the last stage that ran
    report: Report
    artifacts: Mapping[str, Any]  # stage name -> the artifact it returned
    config: CompileConfig  # the configuration the run used


class Pipeline:
    def __init__(self, stages: Sequence[Stage]) -> None:
        for first, second in zip(stages, stages[1:]):
            if not issubclass(first.returns, second.takes):
                raise PipelineError(
                    f"stage {first.name!r} returns {first.returns.__name__} but the next stage "
                    f"{second.name!r} takes {second.takes.__name__}",
                    hint="order the stages so each one takes what the previous returns",
                )
        self.stages = tuple(stages)
        self.names = tuple(s.name for s in stages)

    def execute(
        self,
        artifact: Any,
        backend: Backend,
        config: CompileConfig,
        instruments: Sequence[Instrument] = (),
        *,
        start_after: str | None = None,
        stop_after: str | None = None,
        dependency_checks: bool = False,
        cache: StageCache | None = None,
    ) -> PipelineResult:
        """`cache`: after capture, load the last stage stored for this run and go on after it
        (the stages skipped get cached report rows, and no instrument hook); store what runs."""
        start = self.names.index(start_after) + 1 if start_after else 0
        stop = self.names.index(stop_after) if stop_after else len(self.stages) - 1
        if start > stop or start >= len(self.stages):
            raise ResumeError(
                f"nothing to run: resuming after {start_after!r} and stopping after {stop_after!r}",
                hint="stop after a later stage, or resume from an earlier stage file",
            )
        first = self.stages[start]
        if not isinstance(artifact, first.takes):
            raise ResumeError(
                f"stage {first.name!r} takes {first.takes.__name__}, got {type(artifact).__name__}",
                stage=first.name,
                hint="resume from a stage file written by the stage before it",
            )

        for stage in self.stages[start : stop + 1]:
            stage.check_options(config.options_for(stage.name))
        with scans_only_new_objects(), nonzero_laid_out_by_row(), decomposable_ops_listed_once():
            for instrument in instruments:
                instrument.before_pipeline(config, self.names, artifact)
            records: list[StageRecord] = []
            artifacts: dict[str, Any] = {}
            cached: CacheRun | None = None
            recorded = config.program_record()
            for stage in self.stages[start : stop + 1]:
                skipped = cached.skip(stage.name) if cached is not None else None
                if skipped is not None:  # the cache holds this stage's output or a later one's
                    records.append(skipped.record)
                    if skipped.artifact is not None:
                        artifact = artifacts[stage.name] = skipped.artifact
                    continue
                ctx = StageContext(
                    backend, config.options_for(stage.name), dependency_checks=dependency_checks,
                    program_state=config.program_state, recorded_config=recorded,
                )
                artifact = self._run_stage(stage, artifact, ctx, instruments)
                record = _stage_record(stage, ctx.metrics, instruments)
                logger.info("%s: %.3f s, nodes %s -> %s", stage.name, record.seconds, record.nodes_in, record.nodes_out)
                records.append(record)
                artifacts[stage.name] = artifact
                if cached is not None:
                    with _ONE_STAGE_AT_A_TIME:  # (de)serializing uses the same process-wide state
                        cached.store(stage.name, artifact, record)
                elif cache is not None and stage.name == KEYED_BY:
                    # Capture's output keys every later stage.
                    later = self.names[self.names.index(KEYED_BY) + 1 : stop + 1]
                    with _ONE_STAGE_AT_A_TIME:
                        cached = CacheRun.start(cache, artifact, later, config)
            for instrument in reversed(instruments):
                instrument.after_pipeline(artifact)

        plan = getattr(artifact, "plan", None)
        report = Report(tuple(records), plan.summary() if plan else (), config.to_json(), plan=plan)
        return PipelineResult(artifact, report, artifacts, config)

    @staticmethod
    def _run_stage(stage: Stage, artifact: Any, ctx: StageContext, instruments: Sequence[Instrument]) -> Any:
        with _ONE_STAGE_AT_A_TIME:
            return Pipeline._run_stage_alone(stage, artifact, ctx, instruments)

    @staticmethod
    def _run_stage_alone(stage: Stage, artifact: Any, ctx: StageContext, instruments: Sequence[Instrument]) -> Any:
        try:
            for instrument in instruments:
                instrument.before_stage(stage.name, artifact)
            output = stage.apply(artifact, ctx)
            release_mapped_pages()  # what the stage read of mapped weights leaves the resident set
            for instrument in reversed(instruments):
                instrument.after_stage(stage.name, artifact, output)
            return output
        except CompileError as error:
            error.stage = error.stage or stage.name
            failure = error
        except Exception as exc:
            failure = StageFailure(
                f"stage {stage.name!r} failed: {type(exc).__name__}: {exc}",
                stage=stage.name,
                hint="the chained exception shows where it failed; report it with the saved stage input",
            )
            failure.__cause__ = exc
        for instrument in reversed(instruments):
            instrument.on_failure(stage.name, artifact, failure)
        raise failure


_RECORD_FIELDS = frozenset(attrs.fields_dict(StageRecord)) - {"stage", "metrics", "notes"}


def _stage_record(stage: Stage, metrics: dict[str, Any], instruments: Sequence[Instrument]) -> StageRecord:
    """The stage's row: the instruments' fields, its metrics in its own words, then any other
    key an instrument gave as `key: value`."""
    fields: dict[str, Any] = {}
    notes = [stage.phrase(key, value) for key, value in metrics.items()]
    extra = dict(metrics)
    for instrument in instruments:
        for key, value in instrument.record(stage.name).items():
            if key in _RECORD_FIELDS:
                fields[key] = value
            else:
                extra[key] = value
                notes.append(plain_phrase(key, value))
    return StageRecord(stage=stage.name, metrics=extra, notes=tuple(notes), **fields)
