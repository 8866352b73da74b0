"""The public Python API: compile a model, run what was compiled, compare with eager."""

from __future__ import annotations

import os
from typing import Any, Mapping

import attrs
import torch
from torch.utils import _pytree as pytree

from compiler import backends
from compiler.backends.base import Backend
from compiler.driver import Pipeline, PipelineRun
from compiler.ir.artifacts import EagerModel, ExecutorchProgram
from compiler.ir.errors import ResumeError, UserInputError
from compiler.ir.report import Report
from compiler.ir.serialize import load_stage_file
from compiler.options import DriverOptions
from compiler.stages import DEFAULT_STAGES


@attrs.frozen
class Artifact:
    """A compiled program: the `.pte` bytes, the report, and every stage's artifact."""

    program: ExecutorchProgram
    report: Report
    stages: Mapping[str, Any]

    @property
    def pte(self) -> bytes:
        return self.program.pte

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "wb") as f:
            f.write(self.pte)

    def run(self, *inputs: Any) -> list[torch.Tensor]:
        from compiler.runtime import run

        return run(self, inputs)


def _eager_model(model: Any, example_inputs: Any, dynamic_shapes: Any) -> EagerModel:
    if not isinstance(model, torch.nn.Module):
        raise UserInputError(
            f"the model must be a torch.nn.Module, got {type(model).__name__}",
            stage="capture",
            hint="pass the module object (not its class or a path); for a file use the CLI's path.py:factory",
        )
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise UserInputError(
            f"example_inputs must be a tuple of tensors, got {type(example_inputs).__name__}",
            stage="capture",
            hint="pass example_inputs as a tuple, e.g. (torch.randn(1, 3, 224, 224),)",
        )
    for leaf in pytree.tree_leaves(tuple(example_inputs)):
        if not isinstance(leaf, (torch.Tensor, int, float, bool)) and leaf is not None:
            raise UserInputError(
                f"example_inputs hold a {type(leaf).__name__}; only tensors and Python scalars can be traced",
                stage="capture",
                hint="convert it to a torch.Tensor (e.g. torch.from_numpy)",
            )
    return EagerModel(model, tuple(example_inputs), dynamic_shapes)


def run_pipeline(
    model: torch.nn.Module | None,
    example_inputs: Any = None,
    backend: str | Backend = "portable",
    *,
    backend_options: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = None,
    **driver_options: Any,
) -> PipelineRun:
    """Like `compile`, but returns the run itself: the last artifact, the report, every stage's artifact."""
    options = DriverOptions.from_kwargs(driver_options)
    backend_obj = backends.resolve(backend, backend_options)
    pipeline = Pipeline(DEFAULT_STAGES)

    if options.resume_from:
        stage_file = load_stage_file(options.resume_from)
        if stage_file.backend != backend_obj.name:
            raise ResumeError(
                f"{options.resume_from!r} was compiled for backend {stage_file.backend!r}, "
                f"not {backend_obj.name!r}",
                hint=f"resume with backend={stage_file.backend!r}",
            )
        artifact, start_after = stage_file.artifact, stage_file.stage
    else:
        artifact, start_after = _eager_model(model, example_inputs, dynamic_shapes), None

    instruments, timing, verify = options.build_instruments(backend_obj.name)
    return pipeline.run(
        artifact,
        backend_obj,
        instruments,
        start_after=start_after,
        stop_after=options.stop_after,
        timing=timing,
        verify=verify,
        options=options,
    )


def compile(
    model: torch.nn.Module | None,
    example_inputs: Any = None,
    backend: str | Backend = "portable",
    *,
    backend_options: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = None,
    **driver_options: Any,
) -> Any:
    """Compile `model` to an ExecuTorch program for `backend`.

    `backend_options` use the backend's own option names (those of ExecuTorch's
    partitioner for it). Driver options are the fields of `DriverOptions`
    (verify, dump_dir, print_after_change, stop_after, resume_from, ...).
    Returns an `Artifact`, or with `stop_after` that stage's artifact.
    """
    result = run_pipeline(
        model,
        example_inputs,
        backend,
        backend_options=backend_options,
        dynamic_shapes=dynamic_shapes,
        **driver_options,
    )
    return finish(result)


def finish(result: PipelineRun) -> Any:
    """The user-facing value of a pipeline run: an Artifact if it reached emit."""
    if isinstance(result.result, ExecutorchProgram):
        return Artifact(result.result, result.report, result.artifacts)
    return result.result
