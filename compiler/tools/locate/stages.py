"""Bisection by stage: every kept stage's program run on the same inputs as eager, each held to
the tolerance for what it computes in, the first one outside it named.

For a quantized program the reference is the eager quantized model, and each stage's tolerance
has the check's allowance for its activation quantizers rounding one step otherwise (XNNPACK's
own dynamic scales): a program that passes `--check` is not reported as diverging.

Stages never change their input (the `stage_input_kept` invariant), so each kept artifact still
computes what its stage made. A stage that handed on the program before it (fold with nothing
to fold, the dry run) is not run twice.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import attrs
import torch
from torch.export import ExportedProgram

from compiler.ir.artifacts import EagerModel, ExecutorchProgram
from compiler.stages import STAGE_NAMES
from compiler.tools.locate import compare
from compiler.tools.locate.programs import PayloadRefused, ProgramRun, run_exported, run_pte
from compiler.tools.locate.report import StageError

logger = logging.getLogger(__name__)


@attrs.frozen
class StageBisection:
    rows: tuple[StageError, ...]
    first_bad: str | None
    last_good: str | None  # the last stage before `first_bad` whose program agreed and ran node by node
    runs: Mapping[str, ProgramRun] = attrs.field(factory=dict, repr=False)
    # The first bad stage's delegate payload its runner refused to run (the later stages are not run).
    refused: PayloadRefused | None = None


def _how(artifact: Any, run: ProgramRun) -> str:
    if isinstance(artifact, ExecutorchProgram):
        return "the .pte (LoadedProgram)"
    program = artifact.program
    calls = [n for n in program.graph.nodes if getattr(n.target, "__name__", None) == "executorch_call_delegate"]
    if calls:
        return f"fx interpreter, {len(calls)} delegate call(s) each on its own program"
    return "fx interpreter"


def by_stage(
    stages: Mapping[str, Any], expected: Sequence[Any], inputs: Sequence[Any], dtype: torch.dtype,
    tolerance: float | None = None,
) -> StageBisection:
    """Each kept stage's outputs against `expected` (eager's) on `inputs`, at each stage's own
    tolerance or at the `tolerance` given (absolute, as the check takes it)."""
    quantized = stages.get("quantize")
    steps = None
    if isinstance(quantized, EagerModel) and quantized.float_module is not None:
        steps = compare.activation_allowance(quantized.module, inputs, expected)
    rows: list[StageError] = []
    runs: dict[str, ProgramRun] = {}
    first_bad = last_good = None
    previous_program, previous_name = None, None
    for name in STAGE_NAMES:
        artifact = stages.get(name)
        if artifact is None or isinstance(artifact, EagerModel):
            continue
        program = getattr(artifact, "program", None)
        if isinstance(program, ExportedProgram) and program is previous_program:
            rows.append(StageError(name, f"same program as {previous_name}"))
            continue
        if isinstance(artifact, ExecutorchProgram):
            run = run_pte(artifact, inputs)
        elif isinstance(program, ExportedProgram):
            try:
                run = run_exported(program, inputs)
            except PayloadRefused as refused:  # a payload that cannot run: this stage diverges
                rows.append(StageError(name, f"{_how(artifact, None)}: the payload cannot run", None, None, None, False))
                logger.info("locate: stage %s: %s", name, refused.reason)
                if first_bad is None:
                    return StageBisection(tuple(rows), name, last_good, runs, refused)
                break
            previous_program, previous_name = program, name
        else:
            logger.debug("stage %s: a %s is not run", name, type(artifact).__name__)
            continue
        runs[name] = run
        compared = compare.outputs(run, expected, dtype, steps, tolerance)
        worst = None if any(e is None for e in compared.errors) else compared.max_error
        rows.append(StageError(name, _how(artifact, run), worst, compared.tolerance.absolute, compared.tolerance.rule,
                               compared.passed))
        logger.info("locate: stage %s error %s tolerance %.3g", name, worst, compared.tolerance.absolute)
        if compared.passed and first_bad is None and isinstance(program, ExportedProgram):
            last_good = name
        if not compared.passed and first_bad is None:
            first_bad = name
    return StageBisection(tuple(rows), first_bad, last_good if first_bad else None, runs)
