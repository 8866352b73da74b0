"""The public Python API: compile a model, run what was compiled, compare with eager.

`compile` always returns a `CompileResult`, wherever the run stopped, as ExecuTorch's
ExportSession keeps each stage's output.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import types
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import attrs
import torch
from torch.utils import _pytree as pytree

from compiler import backends
from compiler.driver.config import CompileConfig, dependency_versions, split_options
from compiler.process.dependency_output import DependencyOutput
from compiler.ir.errors import ResumeError, UserInputError
from compiler.ir.targets import BY_NAME

if TYPE_CHECKING:
    from compiler.backends.base import Backend
    from compiler.driver.cache import StageCache
    from compiler.driver.config import DriverOptions
    from compiler.driver.dynamic_dims import DynamicDim
    from compiler.ir.artifacts import EagerModel, ExecutorchProgram, StageArtifacts
    from compiler.reporting.report import Override, Report
    from compiler.driver.stage_files import StageFile
    from compiler.running.runtime import EagerReference

logger = logging.getLogger(__name__)


class _SavesProgram:
    """`pte` and `save` of a result, through its `program` (which names where a run stopped)."""

    @property
    def pte(self) -> bytes:
        return self.program.pte

    def save(self, path: str | os.PathLike) -> tuple[str, ...]:
        """Write the `.pte` to `path` (and its `.ptd` beside it, for a program whose weights are kept
        out of it); the paths written."""
        return self.program.save(path)


def _stage_artifacts(given: Mapping[str, Any]) -> StageArtifacts:
    from compiler.ir.artifacts import StageArtifacts

    return StageArtifacts.of(given)


@attrs.frozen
class CompileResult(_SavesProgram):
    """What a compile made, wherever it stopped: the artifact of its last stage, the report,
    each stage's artifact this run produced (a resumed run: those after its start; a stage
    the cache gave: absent), and the configuration it used. `pte`, `save` and `run` need
    a run that reached emit."""

    artifact: Any
    report: Report
    # `result.stages.partition`, typed; also a mapping by stage name.
    stages: StageArtifacts = attrs.field(converter=lambda given: _stage_artifacts(given))
    config: CompileConfig

    @property
    def stopped_after(self) -> str:
        return self.report.stages[-1].stage

    @property
    def program(self) -> ExecutorchProgram:
        """The emitted program; a `UserInputError` for a run that stopped before emit."""
        from compiler.ir.artifacts import ExecutorchProgram

        if not isinstance(self.artifact, ExecutorchProgram):
            raise UserInputError(
                f"the compile stopped after {self.stopped_after}: it has a {type(self.artifact).__name__}, "
                "not a program to save or run",
                hint="compile without stop_after (or resume from its stage file) to reach emit; "
                "`result.artifact` is what it made",
            )
        return self.artifact

    def run(self, *inputs: Any) -> list[torch.Tensor]:
        """Run the emitted program once on `inputs` (`compiler.run`)."""
        from compiler.running.runtime import run

        return run(self.program, inputs)

    def eager_reference(self, module: torch.nn.Module) -> "EagerReference":
        """What a check compares this program with, the same whichever stages the run kept (a stage
        cache hit keeps none after capture): the eager quantized model of a compile that quantized,
        else `module`; and for a program computing wider than its model, that model as the
        precision stage makes it compute. A module this run did not compile is cast instead."""
        from compiler.running.runtime import EagerReference

        quantize = self.stages.quantize
        quantized = quantize is not None and quantize.float_module is not None
        if quantize is None or not (quantized or quantize.module is module):
            return EagerReference(module)
        precision = functools.cache(self._precision_program)
        return EagerReference(quantize.module, quantized, lambda dtype: precision().module())

    def _precision_program(self) -> torch.export.ExportedProgram:
        """The precision stage's program of this run: its own, else made again (unverified) from the
        latest stage the run kept before it, as the stage ran then."""
        from compiler.driver.config import DriverOptions
        from compiler.driver.instruments import instruments_for
        from compiler.driver.pipeline import Pipeline
        from compiler.stages import STAGE_NAMES, default_stages

        if self.stages.precision is not None:
            return self.stages.precision.program
        start = next(name for name in reversed(STAGE_NAMES[: STAGE_NAMES.index("precision")]) if name in self.stages)
        with DependencyOutput() as output:
            made = Pipeline(default_stages()).execute(
                self.stages[start], backends.resolve(self.config.backend, self.config.backend_options), self.config,
                instruments_for(DriverOptions(verify=False)), start_after=start, stop_after="precision",
            )
        logger.debug("making the precision stage's program again printed: %s", output.leftover)
        return made.artifact.program

    def at_float32(self) -> "CompileResult | None":
        """The same program partitioned and lowered again computing in float32, for a program
        whose delegate computes in float16 (Core ML's default precision, `Target.default_compute_precision`):
        a conversion fault smaller than float16's noise shows only there. (The partition stage runs again because each
        partition's tag holds its compile specs; Core ML's rules do not depend on the compute
        precision, so the partitions are the same.) None for any other program, or when this
        result holds no program from before partition (a run resumed after it)."""
        from compiler.driver.config import DriverOptions
        from compiler.driver.instruments import instruments_for
        from compiler.driver.pipeline import Pipeline
        from compiler.stages import STAGE_NAMES, default_stages

        target = BY_NAME.get(self.config.backend)  # None: a Backend object of the caller's
        options = dict(self.config.backend_options)
        if target is None or str(options.get("compute_precision", target.default_compute_precision)).lower() != "float16":
            return None
        before_partition = STAGE_NAMES[: STAGE_NAMES.index("partition")]
        start = next((name for name in reversed(before_partition) if name in self.stages), None)
        if start is None or self.stopped_after != STAGE_NAMES[-1]:
            logger.info("no float32 conversion: the run kept no program from before partition, or made no .pte")
            return None
        options["compute_precision"] = "float32"
        config = attrs.evolve(self.config, backend_options=options)
        artifact = self.stages[start]
        from compiler.process.memory import RECHECK_RUN_PER_STATE_BYTE, compile_bytes, refuse_unless_it_fits, tensor_bytes

        program = artifact.program
        total, half = tensor_bytes([t for t in (*program.state_dict.values(), *program.constants.values())
                                    if isinstance(t, torch.Tensor)])
        refuse_unless_it_fits(
            compile_bytes(total, half, True, target.lowering_memory) + int(RECHECK_RUN_PER_STATE_BYTE * total),
            "converting the partitions again computing in float32 and running them (the check's float32 re-check)",
            stage="partition",
        )
        if getattr(artifact, "searched", None) is not None:  # the dry run's search: float16's specs
            artifact = attrs.evolve(artifact, searched=None)
        with DependencyOutput() as output:
            result = Pipeline(default_stages()).execute(
                artifact, backends.resolve(self.config.backend, options), config,
                instruments_for(DriverOptions(verify=False)), start_after=start,
            )
        logger.debug("float32 conversion printed: %s", output.leftover)
        return CompileResult(result.artifact, result.report, {**self.stages, **result.artifacts}, config)


def _eager_model(model: Any, example_inputs: Any, dynamic_shapes: Any, calibration: Any = None) -> EagerModel:
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
    from compiler.ir.artifacts import EagerModel

    return EagerModel(model, tuple(example_inputs), dynamic_shapes, _calibration(calibration))


def dynamic_dims(model: torch.nn.Module, example_inputs: Any, dims: Sequence[Any]) -> tuple:
    """`dynamic_shapes` for torch.export from the dynamic sizes as the CLI's `--dynamic-dim` gives them
    (`compiler.driver.dynamic_dims.DynamicDim`s, or (input, dimension, minimum, maximum) tuples): the
    input by forward's parameter name or position, the minimum 1 when None; each size its own
    `torch.export.Dim`, named after the input and dimension, but a size given `same_as` another
    (`mask:1=ids:1`) is that one's Dim, so both inputs take one size."""
    from compiler.driver.dynamic_dims import DynamicDim

    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    names = list(inspect.signature(model.forward).parameters)[: len(inputs)]

    def located(given: str, dim: int) -> tuple[int, str]:
        """The input's position and name, refused unless it is a tensor with that dimension."""
        position = int(given) if given.isdigit() else names.index(given) if given in names else None
        if position is None or position >= len(inputs):
            raise UserInputError(
                f"a dynamic dimension names the input {given!r}, but forward has no input {given!r}",
                stage="capture", hint=f"name an input by its parameter name or position: {', '.join(names)}",
            )
        name, example = names[position] if position < len(names) else given, inputs[position]
        if not isinstance(example, torch.Tensor) or not 0 <= dim < example.dim():
            rank = f"has {example.dim()} dimensions" if isinstance(example, torch.Tensor) else "is not a tensor"
            raise UserInputError(f"the dynamic dimension {dim} of {name}: {name} {rank}", stage="capture")
        return position, name

    shapes: list[dict | None] = [None] * len(inputs)
    made: dict[tuple[int, int], Any] = {}  # (position, dimension) -> its Dim
    given = [DynamicDim(*one) for one in dims]
    for one in sorted(given, key=lambda d: d.same_as is not None):  # each tie after the sizes it names
        position, name = located(one.input, one.dim)
        size = inputs[position].shape[one.dim]
        if one.same_as is None:
            low = 1 if one.min is None else one.min
            if not low <= size <= one.max:
                raise UserInputError(
                    f"the dynamic dimension {one.dim} of {name}: the example's size {size} is outside {low}..{one.max}",
                    stage="capture", hint="give a range that holds the example input's size",
                )
            dim = torch.export.Dim(f"{name}_{one.dim}", min=low, max=one.max)
        else:
            other, other_name = located(*one.same_as)
            dim = made.get((other, one.same_as[1]))
            if dim is None:
                raise UserInputError(
                    f"the dynamic dimension {one} ties {name}'s dim {one.dim} to {other_name}'s dim {one.same_as[1]}, "
                    "which is given no range",
                    stage="capture", hint=f"give that one its range too, e.g. {other_name}:{one.same_as[1]}:1:64",
                )
            if inputs[other].shape[one.same_as[1]] != size:
                raise UserInputError(
                    f"the dynamic dimension {one}: the example's {name} has size {size} there, its {other_name} "
                    f"{inputs[other].shape[one.same_as[1]]}",
                    stage="capture", hint="sizes tied to one are equal: give example inputs of one length",
                )
        made[(position, one.dim)] = dim
        shapes[position] = {**(shapes[position] or {}), one.dim: dim}
    return tuple(shapes)


def model_dynamic_shapes(spec: str, module: Any, example_inputs: Any, own: Any, dims: Sequence[DynamicDim]) -> Any:
    """The `dynamic_shapes` a model built from the MODEL `spec` is compiled (and checked) with: those
    `dims` make, else the factory's own; both is a mistake (the dims would replace the factory's)."""
    if not dims:
        return own
    if own is not None:
        raise UserInputError(
            f"{spec} gives its own dynamic_shapes, which the dynamic dimensions given would replace",
            hint="drop --dynamic-dim (a sweep job's dynamic_dim), or have the factory return (module, "
            "example_inputs) only",
        )
    return dynamic_dims(module, example_inputs, dims)


def _calibration(calibration: Any) -> tuple | None:
    """Calibration inputs as a tuple of input tuples (a single tensor is a tuple of one)."""
    if calibration is None:
        return None
    if isinstance(calibration, torch.Tensor) or not hasattr(calibration, "__iter__"):
        raise UserInputError(
            f"calibration must be an iterable of input tuples, got {type(calibration).__name__}",
            stage="quantize",
            hint="pass e.g. calibration=[(torch.randn(1, 16),) for _ in range(8)]",
        )
    batches = tuple((one,) if isinstance(one, torch.Tensor) else tuple(one) for one in calibration)
    if not batches:
        return None
    return batches


def compile(
    model: torch.nn.Module | None,
    example_inputs: Any = None,
    backend: str | Backend | None = None,
    *,
    backend_options: Mapping[str, Any] | None = None,
    dynamic_shapes: Any = None,
    calibration: Any = None,
    config: CompileConfig | None = None,
    **options: Any,
) -> CompileResult:
    """Compile `model` to an ExecuTorch program for `backend` (default: portable).

    `backend_options` use the backend's own option names (those of ExecuTorch's
    partitioner for it); `dynamic_shapes` as torch.export takes them; `calibration` an
    iterable of input tuples for a static quantize scheme; `config` a
    `CompileConfig`; every other keyword is a stage or driver option by its name
    (`compiler.driver.config.options()`: fold_skip_ops, dry_run_mode, stop_after,
    dump_dir, ...), set on top of `config`. With `resume_from`, the stage file's
    recorded configuration is the base, and what is given here overrides it.
    """
    given, driving = split_options(options)
    # ExecuTorch, torchao and coremltools talk as they load: the pipeline's modules are imported
    # inside the capture, like everything the compile runs.
    with DependencyOutput() if driving.capture_dependency_output else contextlib.nullcontext() as output:
        from compiler.backends.base import Backend
        from compiler.driver.pipeline import Pipeline
        from compiler.driver.instruments import StageMessages, instruments_for
        from compiler.driver.stage_files import load_stage_file
        from compiler.stages import default_stages

        backend_obj = backend if isinstance(backend, Backend) else None
        backend_name = backend_obj.name if backend_obj else backend
        if backend_obj and backend_options:
            raise UserInputError(
                "backend_options were given with a backend object",
                hint="build the backend object with those options instead",
            )
        versions = dependency_versions()
        overrides: tuple[Override, ...] = ()
        if driving.resume_from:
            stage_file = load_stage_file(driving.resume_from)
            chosen = _resumed_config(stage_file, config, backend_name, backend_options, given)
            # What differs from the recorded run: the options given, and the libraries installed.
            overrides = _differences(
                {**stage_file.config.to_json(), "versions": dict(stage_file.versions)},
                {**chosen.to_json(), "versions": versions},
            )
            artifact, start_after = stage_file.artifact, stage_file.stage
        else:
            chosen = (config or CompileConfig()).with_options(given)
            chosen = attrs.evolve(
                chosen,
                backend=backend_name or chosen.backend,
                backend_options=chosen.backend_options if backend_options is None else backend_options,
            )
            artifact, start_after = _eager_model(model, example_inputs, dynamic_shapes, calibration), None
            from compiler.stages.quantize import check_calibration, coded_weights

            check_calibration(chosen.quantize, chosen.backend, artifact.calibration)
            from compiler.ir.mapped import is_mapped
            from compiler.process.memory import (
                STREAMED_BYTES, compile_bytes, freed_tensors_returned, refuse_unless_it_fits, tensor_bytes,
            )

            tensors = [*artifact.module.parameters(), *artifact.module.buffers()]
            freed_tensors_returned(tensor_bytes(tensors)[0])
            if driving.memory_check and chosen.backend in BY_NAME:
                target = BY_NAME[chosen.backend]
                # Weights mapped from a checkpoint are streamed: each stage holds a piece of them at a time.
                held = [t for t in tensors if not is_mapped(t)]
                total, half = tensor_bytes(held)
                coded, tied = coded_weights(artifact.module, chosen.quantize, chosen.backend)
                tied_ids = {id(t) for t in tied}
                coded = [t for t in coded if not is_mapped(t)]
                quantized = (*tensor_bytes(t for t in coded if id(t) not in tied_ids), sum(t.numel() for t in coded))
                refuse_unless_it_fits(
                    compile_bytes(total, half, target.no_bfloat16 is not None, target.lowering_memory, quantized)
                    + (STREAMED_BYTES if len(held) < len(tensors) else 0),
                    f"compiling this model for {target.display_name}", stage="capture",
                    hint=(
                        "quantize the model (a scheme holds 4- or 8-bit weights)" if not coded
                        else "the estimate counts the weights the scheme codes at 3 bytes each and the rest as "
                        "float32 (--quantize-embedding codes embedding tables too)"
                    ) + (
                        f"; lowering to {target.display_name} holds {target.lowering_memory:g}x the float32 weights "
                        "it does not code" if target.lowering_memory > 1 else ""
                    ),
                )

        backend_obj = backend_obj or backends.resolve(chosen.backend, chosen.backend_options)
        instruments = instruments_for(driving)
        if output is not None:
            instruments.insert(0, StageMessages(output))
        result = Pipeline(default_stages()).execute(
            artifact,
            backend_obj,
            chosen,
            instruments,
            start_after=start_after,
            stop_after=driving.stop_after,
            dependency_checks=driving.dependency_checks,
            cache=_stage_cache(driving, backend if isinstance(backend, Backend) else None),
        )
        report = attrs.evolve(result.report, versions=versions, resumed_from=driving.resume_from, overrides=overrides)
        return CompileResult(result.artifact, report, result.artifacts, result.config)


def with_quantized_model(
    result: CompileResult, model: torch.nn.Module, example_inputs: Any, dynamic_shapes: Any = None, calibration: Any = None
) -> CompileResult:
    """A result without its quantize stage's artifact (a resumed run) whose configuration
    quantizes, given it again from `model`: the eager quantized model its check compares
    with. Static schemes need the same `calibration` as the run that quantized."""
    options = result.config.quantize
    if "quantize" in result.stages or (options.scheme is None and options.embedding is None):
        return result
    from compiler.stages.quantize import check_calibration, quantize_model

    eager = _eager_model(model, example_inputs, dynamic_shapes, calibration)
    check_calibration(options, result.config.backend, eager.calibration)
    module, _ = quantize_model(eager, options, result.config.backend)
    quantized = attrs.evolve(eager, module=module, float_module=model)
    return attrs.evolve(result, stages={**result.stages, "quantize": quantized})


def program_reference(
    program: str | os.PathLike, model: torch.nn.Module, example_inputs: Any, dynamic_shapes: Any = None,
    calibration: Any = None,
) -> "EagerReference":
    """What a check of the `.pte` at `program` compares it with, as its compile's check did
    (`CompileResult.eager_reference`): a program that records its configuration (one that
    quantized) is compared with `model` quantized again by it; another with `model`, computing
    where the program computes wider as the precision stage makes a program compute in that dtype.
    Static schemes need the same `calibration` as the compile."""
    from compiler.ir.program_data import ProgramData, flatbuffer_program, recorded_config
    from compiler.running.runtime import EagerReference

    recorded = recorded_config(flatbuffer_program(ProgramData(path=os.fspath(program), owned=False)))
    if recorded is not None:
        config = CompileConfig.from_json(recorded)
        return _through_quantize(model, example_inputs, dynamic_shapes, calibration, config).eager_reference(model)

    @functools.cache
    def in_precision(dtype: torch.dtype) -> EagerReference:
        config = CompileConfig().with_options({"precision": str(dtype).removeprefix("torch.")})
        return _through_quantize(model, example_inputs, dynamic_shapes, calibration, config).eager_reference(model)

    return EagerReference(model, widened=lambda dtype: in_precision(dtype).widened(dtype))


def _through_quantize(model: torch.nn.Module, example_inputs: Any, dynamic_shapes: Any, calibration: Any,
                      config: CompileConfig) -> CompileResult:
    """`model` through the quantize stage of `config` (unverified, uncached): where the stages a
    check's reference is made by start."""
    return compile(
        model, example_inputs, dynamic_shapes=dynamic_shapes, calibration=calibration, config=config,
        stop_after="quantize", cache=False, reproducer=False, memory_check=False, verify=False,
    )


def _stage_cache(driving: DriverOptions, given_backend: Backend | None) -> StageCache | None:
    """The stage cache a run uses (`StageCache.for_run`); none for a backend object, whose
    options the configuration does not hold."""
    from compiler.driver.cache import StageCache

    if given_backend is not None and driving.cache and driving.cache_dir:
        logger.info("stage cache not used: the backend was given as an object")
        return None
    return StageCache.for_run(driving)


def _resumed_config(
    stage_file: StageFile,
    config: CompileConfig | None,
    backend: str | None,
    backend_options: Mapping[str, Any] | None,
    given: Mapping[str, Any],
) -> CompileConfig:
    """The recorded configuration with what the caller gave on top: a whole `config`
    replaces it, a backend option replaces that one option, a stage option that option."""
    from compiler.ir.artifacts import AtenProgram, PlannedProgram

    recorded = stage_file.config
    chosen = (config or recorded).with_options(given)
    if backend and backend != recorded.backend:
        if not isinstance(stage_file.artifact, AtenProgram) or isinstance(stage_file.artifact, PlannedProgram):
            raise ResumeError(
                f"the stage file was planned for backend {recorded.backend!r} after {stage_file.stage}; "
                f"it cannot go on for {backend!r}",
                hint="resume with its own backend, or from a stage file of capture or fold",
            )
        chosen = attrs.evolve(chosen, backend=backend, backend_options=backend_options or {})
    elif backend_options:
        chosen = attrs.evolve(chosen, backend_options={**chosen.backend_options, **backend_options})
    replayed = config is None and chosen.backend == recorded.backend
    missing = sorted(set(stage_file.unrecorded) - set(chosen.backend_options)) if replayed else []
    if missing:
        raise ResumeError(
            "the stage file could not record the backend option(s) "
            + ", ".join(f"{name} ({stage_file.unrecorded[name]})" for name in missing),
            hint="give them again as backend options",
        )
    return chosen


def _differences(recorded: Mapping[str, Any], chosen: Mapping[str, Any], prefix: str = "") -> tuple[Override, ...]:
    """The options whose JSON differs between two configurations, by dotted name."""
    from compiler.reporting.report import Override

    found: list[Override] = []
    for key in sorted(set(recorded) | set(chosen)):
        old, new = recorded.get(key), chosen.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            found += _differences(old, new, f"{prefix}{key}.")
        elif old != new:
            found.append(Override(f"{prefix}{key}", old, new))
    return tuple(found)


@attrs.frozen
class MethodsResult(_SavesProgram):
    """A compile of several methods into one program: each method's run through lower (its
    stage files, cache entries, report and resume are its own) and the one emit of them all.
    `pte`, `save` and `run` need a run that reached emit."""

    methods: Mapping[str, CompileResult]
    artifact: Any  # the ExecutorchProgram of every method; None when the methods stopped before emit
    report: Any  # MethodsReport
    # Each method's eager callable, the check's reference (none for a method resumed from a stage file).
    eager: Mapping[str, Any]

    @property
    def program(self) -> ExecutorchProgram:
        if self.artifact is None:
            stopped = next(iter(self.methods.values())).stopped_after
            raise UserInputError(
                f"the compile stopped after {stopped}: it has each method's artifact, not a program to save or run",
                hint="compile without stop_after to reach emit; `result.methods[name].artifact` is what it made",
            )
        return self.artifact


class _Method(torch.nn.Module):
    """One method of a module as a module torch.export captures: every method of one module
    then names its weights and buffers alike (`owner.<path>`), so the state they share is planned once."""

    def __init__(self, owner: torch.nn.Module, name: str) -> None:
        super().__init__()
        self.owner = owner
        self.method = name

    def forward(self, *args: Any) -> Any:
        return getattr(self.owner, self.method)(*args)


def _method_module(name: str, given: Any) -> tuple[torch.nn.Module, Any]:
    """(the module to capture, the callable eager runs) of one method: a module, or a bound method of one."""
    if isinstance(given, torch.nn.Module):
        return _Method(given, "forward"), given
    owner = getattr(given, "__self__", None)
    if isinstance(owner, torch.nn.Module) and callable(given):
        return _Method(owner, given.__name__), given
    raise UserInputError(
        f"method {name!r}: {type(given).__name__} is neither a torch.nn.Module nor a method of one",
        stage="capture",
        hint="give a module or a bound method of one (model.prefill), with its example inputs",
    )


def _method_dynamic_shapes(name: str, method: Any, dynamic: Any) -> Any:
    """A method's dynamic shapes (per input, or by its parameters' names) for its `_Method`, whose
    forward takes the inputs as one `*args`."""
    if dynamic is None:
        return None
    if isinstance(dynamic, Mapping):
        parameters = list(inspect.signature(method).parameters)
        unknown = sorted(set(dynamic) - set(parameters))
        if unknown:
            raise UserInputError(
                f"method {name!r}: dynamic shapes name no parameter of it: {', '.join(unknown)}",
                stage="capture", hint=f"name its parameters ({', '.join(parameters)}) or give one entry per input",
            )
        dynamic = tuple(dynamic.get(parameter) for parameter in parameters)
    return (tuple(dynamic),)


def _methods_given(methods: Any) -> dict[str, Any]:
    """Each method's (module, example inputs, dynamic shapes) or stage file, checked before any work."""
    if not isinstance(methods, Mapping) or not methods:
        raise UserInputError(
            "no methods to compile" if isinstance(methods, Mapping) else
            f"methods must be a dict of name -> (module, example inputs), got {type(methods).__name__}",
            hint="give e.g. {'prefill': (model.prefill, (tokens, pos)), 'decode': (model.decode, (token, pos))}",
        )
    given: dict[str, Any] = {}
    for name, spec in methods.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise UserInputError(f"{name!r} is not a method name", hint="name each method by an identifier, e.g. decode")
        if isinstance(spec, (str, os.PathLike)):
            given[name] = os.fspath(spec)
            continue
        if not isinstance(spec, tuple) or len(spec) not in (2, 3):
            raise UserInputError(
                f"method {name!r}: give (module, example inputs) or (module, example inputs, dynamic shapes), "
                f"or a stage file to resume it from; got {type(spec).__name__}",
                hint="e.g. {'decode': (model.decode, (token, pos))}",
            )
        module, eager = _method_module(name, spec[0])
        given[name] = (module, eager, spec[1], _method_dynamic_shapes(name, eager, spec[2] if len(spec) == 3 else None))
    _state_named_once(given)
    return given


def _state_named_once(given: Mapping[str, Any]) -> None:
    """A buffer two methods reach under two names would be two states in the program: refused."""
    names: dict[int, set[str]] = {}
    for spec in given.values():
        if isinstance(spec, tuple):
            for name, buffer in spec[0].named_buffers(remove_duplicate=False):
                names.setdefault(id(buffer), set()).add(name)
    twice = sorted(sorted(found) for found in names.values() if len(found) > 1)
    if twice:
        raise UserInputError(
            "the methods reach one buffer under several names: " + "; ".join(" and ".join(n) for n in twice),
            stage="capture",
            hint="give the methods as bound methods of the one module that holds the state (model.prefill, "
            "model.decode), so the program plans it once",
        )


@contextlib.contextmanager
def _named_method_errors():
    """A compile error of one method names it (`method.name`, set by the caller as it goes)."""
    from compiler.ir.errors import CompileError

    method = types.SimpleNamespace(name=None)
    try:
        yield method
    except CompileError as error:
        error.reason = f"method {method.name!r}: {error.reason}"
        error.args = (error.reason,)
        raise


def _written_state_is_one(given: Mapping[str, Any], written: set[str]) -> None:
    """A buffer name some method writes is one state in the program: refused when the methods'
    modules hold different tensors under it (two modules of one class given apart)."""
    tensors: dict[str, dict[int, str]] = {}
    for name, spec in given.items():
        if isinstance(spec, tuple):
            for path, buffer in spec[0].named_buffers():
                if path in written:
                    tensors.setdefault(path, {}).setdefault(id(buffer), name)
    apart = {path: held for path, held in tensors.items() if len(held) > 1}
    if apart:
        raise UserInputError(
            "the methods hold different buffers under one name the program plans once: "
            + "; ".join(f"{path} (methods {', '.join(held.values())})" for path, held in sorted(apart.items())),
            stage="capture",
            hint="give the methods as methods of the one module that holds the state, or give each state its own name",
        )


def _written_state(
    spec: Any, backend: Any, backend_options: Any, config: Any, given: Mapping[str, Any], driving: DriverOptions
) -> set[str]:
    """The buffers a method writes, from its program as captured with the options `given` (or as its
    stage file holds it)."""
    from compiler.driver.stage_files import load_stage_file
    from compiler.ir.graph import written_buffers

    if isinstance(spec, str):
        return written_buffers(load_stage_file(spec).artifact.program)
    module, _, inputs, dynamic = spec
    captured = compile(
        module, inputs, backend, backend_options=backend_options, dynamic_shapes=dynamic, config=config, **given,
        stop_after="capture", reproducer=False, cache=False, capture_dependency_output=driving.capture_dependency_output,
    )
    return written_buffers(captured.artifact.program)


def compile_methods(
    methods: Mapping[str, Any],
    backend: str | None = None,
    *,
    backend_options: Mapping[str, Any] | None = None,
    config: CompileConfig | None = None,
    **options: Any,
) -> MethodsResult:
    """Compile several named methods into one program (prefill and decode, encoder and decoder).

    `methods`: name -> (module or bound method of one, example inputs[, dynamic shapes]), or a
    stage file of that method to resume from. Each method runs the stages through lower on its
    own (with `dump_dir`, into `dump_dir/<method>/`), then one emit makes the `.pte` of them all:
    weights the methods share are stored once, and a buffer they share (one KV cache, given as
    methods of the module holding it) is one state, planned once. Options as `compile`'s; the
    emit's are those each method's run records."""
    from compiler.driver.instruments import StageMessages, instruments_for
    from compiler.driver.pipeline import Pipeline
    from compiler.ir.artifacts import LoweredMethods
    from compiler.reporting.report import MethodsReport
    from compiler.stages.emit import EmitMethods
    from compiler.stages.options import constant_method_values

    given = _methods_given(methods)
    chosen, driving = split_options(options)
    constant = constant_method_values(chosen.get("emit_constant_methods", config.emit.constant_methods if config else ()))
    clash = sorted(set(constant) & set(given))
    if clash:
        raise UserInputError(
            f"emit_constant_methods names the method(s) {', '.join(clash)} the program compiles",
            stage="emit", hint="give the metadata methods other names",
        )
    emits = driving.stop_after in (None, "emit")
    per_method = {**options, "stop_after": "lower" if emits else driving.stop_after}
    results: dict[str, CompileResult] = {}
    with _named_method_errors() as method:
        written = {}
        for method.name, spec in given.items():
            written[method.name] = _written_state(spec, backend, backend_options, config, chosen, driving)
        _written_state_is_one(given, set().union(*written.values()))
        for method.name, spec in given.items():
            # State the other methods write stays the program's where this method's delegates read it.
            state = sorted(set().union(*(w for other, w in written.items() if other != method.name)))
            folders = {
                key: os.path.join(os.fspath(options[key]), method.name)
                for key in ("dump_dir", "reproducer_dir") if options.get(key)
            }
            run = {**per_method, **folders, "partition_program_state": tuple(state)}
            if isinstance(spec, str):
                results[method.name] = compile(
                    None, backend=backend, backend_options=backend_options, config=config, **run, resume_from=spec
                )
            else:
                module, _, inputs, dynamic = spec
                results[method.name] = compile(
                    module, inputs, backend, backend_options=backend_options, dynamic_shapes=dynamic, config=config,
                    **run,
                )
    eager = {name: spec[1] for name, spec in given.items() if isinstance(spec, tuple)}
    reports = {name: result.report for name, result in results.items()}
    if not emits:
        return MethodsResult(results, None, MethodsReport(reports), eager)
    configs = {name: result.config for name, result in results.items()}
    emit_config = next(iter(configs.values()))
    differ = sorted(name for name, one in configs.items() if one.backend != emit_config.backend)
    if differ:
        raise UserInputError(
            f"the methods were lowered for different backends: {', '.join(f'{n} ({configs[n].backend})' for n in configs)}",
            stage="emit", hint="compile (or resume) every method for one backend",
        )
    top = attrs.evolve(driving, stop_after=None, resume_from=None)
    with DependencyOutput() if driving.capture_dependency_output else contextlib.nullcontext() as output:
        instruments = instruments_for(top)
        if output is not None:
            instruments.insert(0, StageMessages(output))
        lowered = {name: result.artifact for name, result in results.items()}
        lowered = backends.load(emit_config.backend).share_method_weights(lowered)
        emitted = Pipeline([EmitMethods()]).execute(
            LoweredMethods(lowered),
            backends.resolve(emit_config.backend, emit_config.backend_options),
            emit_config,
            instruments,
        )
    report = MethodsReport(reports, emitted.report.stages[0], emit_config.to_json())
    return MethodsResult(results, emitted.artifact, report, eager)


def check_methods(result: Any, calls: Any, eager: Mapping[str, Any] | None = None, tolerance: float | None = None):
    """The sequence of `calls` ((method, inputs) pairs) run by the program and by eager, compared
    call by call (`compiler.running.methods.check_methods`); `eager` defaults to the methods compiled."""
    from compiler.running.methods import check_methods as check

    return check(result, calls, eager if eager is not None else getattr(result, "eager", {}), tolerance)
