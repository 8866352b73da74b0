"""Running compiled programs on this machine, and comparing them with eager PyTorch."""

from __future__ import annotations

import gc
import os
import pathlib
import tempfile
from typing import Any, Callable, Sequence

import attrs
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from compiler import backends
from compiler.process.dependency_output import DependencyOutput
from compiler.ir.artifacts import ExecutorchProgram
from compiler.ir.errors import InsufficientMemory, UnsupportedByRuntime, UserInputError
from compiler.ir.mapped import cast_into_file, is_mapped, pages_released_as_it_runs
from compiler.ir.kernels import load_llm_kernels, load_quantized_kernels
from compiler.ir.program_data import ProgramData, data_file_path, delegate_payload, flatbuffer_program
from compiler.ir.targets import BY_DELEGATE_ID
from compiler.running.activation_steps import activation_steps, quantizes_activations
from compiler.running.tolerance import Tolerance, abs_error, largest_finite, max_abs_error


@attrs.frozen
class _Loadable:
    """A program to load: its bytes (a file is read only as far as its flatbuffer), its data file
    if it has one, that flatbuffer, and the delegates it calls."""

    data: ProgramData
    weights: ProgramData | None
    flatbuffer: Any
    delegates: frozenset[str]


def _loadable(program: Any, weights: str | os.PathLike | None = None) -> _Loadable:
    """`weights`: the data file of a program given as bytes or a path (a `.ptd` beside a path is
    found by itself)."""
    if isinstance(program, (str, os.PathLike)):
        path = pathlib.Path(program)
        if not path.is_file():
            raise UserInputError(f"no program file at {str(path)!r}", hint="give the path of a .pte file")
        beside = pathlib.Path(data_file_path(path))
        if weights is None and beside.is_file():
            weights = beside
        program = ProgramData(path=str(path), owned=False)
    elif isinstance(program, (bytes, bytearray, memoryview)):
        program = ProgramData(bytes(program))
    if isinstance(program, ProgramData):
        try:
            flatbuffer = flatbuffer_program(program)
        except Exception as exc:  # the flatbuffer reader fails in many ways on a non-program
            raise UserInputError(
                f"these {len(program)} bytes are not an ExecuTorch program ({type(exc).__name__}: {exc})",
                hint="give the bytes of a .pte file, as written by to_executorch() or compiler.compile",
            ) from exc
        data_file = ProgramData(path=os.fspath(weights), owned=False) if weights is not None else None
        delegates = frozenset(d.id for plan in flatbuffer.execution_plan for d in plan.delegates)
        return _Loadable(program, data_file, flatbuffer, delegates)
    program = getattr(program, "program", program)
    if not isinstance(program, ExecutorchProgram):
        raise UserInputError(
            f"cannot run a {type(program).__name__}: only emitted programs run",
            hint="give a CompileResult that reached emit, the bytes of a .pte or its path",
        )
    return _Loadable(program.data, program.weights, flatbuffer_program(program.data), frozenset(program.delegates))


def _refuse_missing_data_file(loadable: _Loadable) -> None:
    """A named error for a program that reads data kept out of it, given without its data file:
    a tensor stored externally, or named data a payload reads that the `.pte` does not hold (on
    which ExecuTorch's XNNPACK delegate crashes the process instead of failing)."""
    from executorch.exir import schema

    if loadable.weights is not None:
        return
    held = {entry.key for entry in loadable.flatbuffer.named_data or ()}
    missing: set[str] = set()
    for plan in loadable.flatbuffer.execution_plan:
        for value in plan.values:
            info = getattr(value.val, "extra_tensor_info", None)
            if info is not None and info.location == schema.TensorDataLocation.EXTERNAL:
                missing.add(info.fully_qualified_name)
        for delegate in plan.delegates:
            keys = backends.named_data_keys(delegate.id)
            read = keys(delegate_payload(loadable.data, loadable.flatbuffer, delegate)) if keys is not None else set()
            if read and not read & held:  # a payload whose weights were all written elsewhere
                missing |= read
    if missing:
        raise UserInputError(
            f"the program reads {len(missing)} tensor(s) kept out of the .pte (e.g. {sorted(missing)[0]!r}), and no "
            "data file was given",
            hint="a program compiled with external weights loads with its .ptd: keep PROGRAM.ptd beside "
            "PROGRAM.pte (compiler.run(path) finds it there)",
        )


def _loaded_from_files(runtime: Any, loadable: _Loadable) -> Any:
    """ExecuTorch's runtime loads a program with a data file only from files: bytes held in memory
    are written to temporary files first; a program in a file is mapped, not read."""
    if loadable.weights is None:
        return runtime.load_program(loadable.data.path or loadable.data.read())
    with tempfile.TemporaryDirectory(prefix="staged-compiler-") as folder:
        paths = []
        for data, name in ((loadable.data, "program.pte"), (loadable.weights, "program.ptd")):
            if data.path is None:
                data.save(os.path.join(folder, name))
            paths.append(data.path or os.path.join(folder, name))
        return runtime.load_program(paths[0], data_path=paths[1])


# A reference program this large is collected as soon as it is released: its objects hold each
# other in cycles, and a check's eager runs should not start with it still held.
COLLECT_AFTER_BYTES = 64 << 20

# Kernels that convert a dtype: they compute nothing in either.
_CONVERSIONS = ("aten::_to_copy", "dim_order_ops::_to_dim_order_copy")


def _computes_its_own_dtype(delegate_id: str) -> bool:
    """A delegate that computes bfloat16 (MLX) may do so between float32 inputs and outputs: its
    boundary says nothing of what it computes in. One without bfloat16 kernels computes in its
    boundary's dtype."""
    target = BY_DELEGATE_ID.get(delegate_id)
    return target is not None and target.no_bfloat16 is None and target.default_compute_precision is None


def _input_bounds(program: Any) -> dict[str, list[tuple[list[int], bool] | None]]:
    """Method -> per input, the sizes its memory was planned for (a dynamic size's maximum) and
    whether it may be given smaller; None for an input that is not a tensor."""
    from executorch.exir import schema

    return {
        plan.name: [
            (list(value.sizes), value.shape_dynamism != schema.TensorShapeDynamism.STATIC)
            if isinstance(value := plan.values[index].val, schema.Tensor) else None
            for index in plan.inputs
        ]
        for plan in program.execution_plan
    }


def _refuse_unplanned_sizes(leaves: Sequence[Any], bounds: list, method: str) -> None:
    """A named error for an input the program has no memory for, instead of the runtime's
    'set_inputs() failed with error 0x10' or the reference executor's resize error."""
    for position, (leaf, bound) in enumerate(zip(leaves, bounds)):
        if bound is None or not isinstance(leaf, torch.Tensor):
            continue
        sizes, dynamic = bound
        where = f"input {position} of {method}"
        if leaf.dim() != len(sizes):
            raise UserInputError(f"{where} has {leaf.dim()} dimensions; the program takes {len(sizes)}")
        for dim, (given, planned) in enumerate(zip(leaf.shape, sizes)):
            if given > planned or (not dynamic and given != planned):
                raise UserInputError(
                    f"{where} has size {given} in dimension {dim}, "
                    + (f"above the program's {planned} (the top of the dimension's declared range, which its "
                       "memory is planned for)" if dynamic else f"where the program takes only {planned}"),
                    hint="compile with the dimension dynamic over a range that holds this size "
                    "(dynamic_shapes, torch.export.Dim(name, max=N))",
                )


def _written_inputs(program: Any) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per method, (output position, input position) of each output that is an input's new value.
    ExecuTorch writes a mutated user input back (`aten::copy_` into the input's value slot) and
    returns that slot as a method output ahead of the model's own; a program returning an input
    unchanged returns its slot too, but writes nothing into it."""
    from executorch.exir import schema

    written = {}
    for plan in program.execution_plan:
        inputs = list(plan.inputs)
        copies = {
            call.args[0]
            for chain in plan.chains for call in (i.instr_args for i in chain.instructions)
            if isinstance(call, schema.KernelCall) and plan.operators[call.op_index].name == "aten::copy_"
        }
        written[plan.name] = tuple(
            (at, inputs.index(v)) for at, v in enumerate(plan.outputs) if v in inputs and v in copies
        )
    return written


def _computed_dtype(program: Any) -> torch.dtype | None:
    from executorch.exir import schema

    from compiler.running.reference import TORCH_DTYPES

    dtypes = []
    for plan in program.execution_plan:
        for instruction in (i for chain in plan.chains for i in chain.instructions):
            call = instruction.instr_args
            if isinstance(call, schema.KernelCall) and plan.operators[call.op_index].name in _CONVERSIONS:
                continue
            if isinstance(call, schema.DelegateCall) and _computes_its_own_dtype(plan.delegates[call.delegate_index].id):
                continue
            if isinstance(call, (schema.KernelCall, schema.DelegateCall)):
                values = (plan.values[index].val for index in call.args)
                dtypes += [TORCH_DTYPES.get(v.scalar_type) for v in values if isinstance(v, schema.Tensor)]
    return _least_precise(dtypes)


class LoadedProgram:
    """A program loaded once and run as often as wanted; its mutable state carries
    from one run to the next, as on a device.

    Delegates this machine's ExecuTorch runtime has run there; a program with any
    other delegate runs whole in the reference executor (`compiler/running/reference.py`),
    which runs CPU kernels with torch and each delegate with its reference runner.
    """

    def __init__(self, program: Any, weights: str | os.PathLike | None = None) -> None:
        """`weights`: the data file (`.ptd`) of a program given as bytes or a path, when it is not
        beside it."""
        # ExecuTorch's runtime talks as it loads (cpuinfo, from C): kept in `messages`, off the terminal.
        with DependencyOutput() as output:
            self._load(program, weights)
        self.messages = output.leftover

    def _load(self, program: Any, weights: str | os.PathLike | None) -> None:
        from executorch.runtime import Runtime

        loadable = _loadable(program, weights)
        deserialized, delegates = loadable.flatbuffer, loadable.delegates
        # The least precise floating dtype the program's kernels and delegates take or make, dtype
        # conversions aside (a bfloat16 model computed in float32 converts at its edges).
        self.computes_in = _computed_dtype(deserialized)
        # A delegate computing in a dtype of its own (MLX: the model's bfloat16 between float32
        # edges): what its CPU kernels take says nothing of what the program computes in.
        self.delegate_dtypes_unknown = any(_computes_its_own_dtype(d) for d in delegates)
        self._bounds = _input_bounds(deserialized)
        self._written = _written_inputs(deserialized)
        runtime = Runtime.get()
        missing = sorted(d for d in delegates if not runtime.backend_registry.is_available(d))
        unrunnable = [d for d in missing if backends.delegate_runner(d) is None]
        if unrunnable:
            raise UnsupportedByRuntime(
                "the program holds delegates this machine can run neither with its ExecuTorch "
                f"runtime nor with a reference runner: {', '.join(unrunnable)}",
                hint=f"run it on {'; '.join(backends.runs_on(d) for d in unrunnable)} "
                f"(this runtime has {', '.join(runtime.backend_registry.registered_backend_names)})",
            )
        self._reference = None
        self._reference_bytes = 0
        self._released_float16 = False
        if missing:
            from compiler.running.reference import ReferenceExecutor

            from compiler.process.memory import refuse_unless_it_fits

            size = len(loadable.data) + (len(loadable.weights) if loadable.weights is not None else 0)
            per_byte = max(BY_DELEGATE_ID[d].reference_run_memory for d in missing)
            refuse_unless_it_fits(
                int(per_byte * size),
                f"running the {', '.join(missing)} payloads in the reference executor", stage="run",
                hint="check on a machine with more memory, or run the program where its delegate runs",
            )
            weights_bytes = loadable.weights.read() if loadable.weights is not None else None
            self._reference = ReferenceExecutor(loadable.data.read(), weights=weights_bytes)
            self._reference_bytes = size
            self._execute = self._reference.run
        else:
            load_quantized_kernels()
            load_llm_kernels()
            # The program is kept while its methods run: they read the program's data. Its methods
            # share the host arenas, so the state a program of several methods shares is one.
            _refuse_missing_data_file(loadable)
            program = _loaded_from_files(runtime, loadable)
            # Loaded now, while the runtime's talk (cpuinfo, as a delegate initializes) is captured;
            # the program caches its methods, so each call finds its method loaded.
            for name in program.method_names:
                program.load_method(name)
            self._execute = lambda inputs, method: program.load_method(method).execute(inputs)

    @property
    def computes_in_float16(self) -> bool:
        """Whether a delegate run so far computes in float16 (known after the first run)."""
        if self._reference is None:
            return self._released_float16
        return self._reference.computes_in_float16

    def release(self) -> None:
        """Drop the program and what runs it. A reference runner's program objects (coremltools'
        MIL ops and vars) hold each other in cycles, so their weights would wait for the
        collector: a check's eager runs would start with a 3B model's program still held."""
        self._released_float16 = self.computes_in_float16
        referenced, self._reference = self._reference is not None, None
        self._execute = _released
        # ExecuTorch's own runtime frees its program at once: no collection needed. A small
        # reference program is left to the collector: a full collection in a large heap takes
        # longer (0.3 s) than running the program did.
        if referenced and self._reference_bytes >= COLLECT_AFTER_BYTES:
            gc.collect()

    def __call__(self, inputs: Sequence[Any], method: str = "forward") -> list[torch.Tensor]:
        leaves = list(pytree.tree_leaves(tuple(inputs)))
        _refuse_unplanned_sizes(leaves, self._bounds.get(method, []), method)
        # Cloned: an output may live in the program's planned memory, which the next run reuses.
        outputs = [t.clone() if isinstance(t, torch.Tensor) else t for t in self._execute(leaves, method)]
        return _inputs_written_back(outputs, leaves, self._written.get(method, ()))


def _inputs_written_back(outputs: list[Any], leaves: list[Any], written: tuple[tuple[int, int], ...]) -> list[Any]:
    """The model's own outputs; each input the model writes gets its new value, as in eager."""
    for at, given in written:
        if isinstance(leaves[given], torch.Tensor):
            leaves[given].copy_(outputs[at])
    returned_inputs = {at for at, _ in written}
    return [out for at, out in enumerate(outputs) if at not in returned_inputs]


def _released(inputs: Sequence[Any], method: str) -> list[torch.Tensor]:
    raise RuntimeError("this LoadedProgram was released: load the program again to run it")


def run(artifact: Any, inputs: Sequence[Any], weights: str | os.PathLike | None = None) -> list[torch.Tensor]:
    """Run an emitted program (a CompileResult, the bytes of any `.pte`, or its path) once on
    `inputs`; returns its outputs flattened. `weights`: its data file, when not beside it (one
    `share_weights` wrote for several programs)."""
    return LoadedProgram(artifact, weights)(inputs)


@attrs.frozen
class CheckResult:
    max_abs_error: float  # over every output
    max_rel_error: float
    outputs: int
    largest_expected: float  # the largest |eager value| among floating-point outputs
    tolerance: Tolerance
    # The largest error in an integer or bool output: by default these must match exactly
    # (a program that computes an integer through float16 is wrong, whatever its scale).
    integer_error: float = 0.0
    integers_exact: bool = True
    # Per output, in order: its largest absolute and relative error.
    output_errors: tuple[tuple[float, float], ...] = ()
    # What the program was compared with, and its largest error against the model as given
    # where that is not the reference: the float model of a quantized program (the error
    # quantization makes), the narrower model of a program computing wider (the precision's).
    reference: str = "the eager model"
    quantization_error: float | None = None
    precision_error: float | None = None
    # A program with dynamic input sizes runs at the ends of their ranges too: the sizes it ran
    # at besides the example's, the one the errors above are from (None: the example's), and
    # how a run at one of them failed.
    sizes: tuple[str, ...] = ()
    worst_at: str | None = None
    error: str | None = None
    # For a Core ML program computing in float16: the same partitions computing in float32,
    # checked at float32's tolerance (a conversion fault below float16's noise fails there).
    at_float32: "CheckResult | None" = None
    float32_skipped: str | None = None  # why the float32 re-check did not run (the memory it needs)

    @property
    def passed(self) -> bool:
        if self.error or (self.integers_exact and self.integer_error):
            return False
        if self.at_float32 is not None and not self.at_float32.passed:
            return False
        return self.max_abs_error <= self.tolerance.absolute or self.judged_at_float32

    @property
    def judged_at_float32(self) -> bool:
        """A float16 program with quantized activations over its float16 tolerance while the same
        partitions computing in float32 pass theirs: float16's rounding moves values across
        requantization steps, compounding over many of them (ACT on Core ML: 269), which the
        one-step tolerance does not model. The float32 check judges it; float16 is said to be
        the cause, with both figures."""
        return (
            self.at_float32 is not None and self.at_float32.passed and self.tolerance.activation_quantizers > 0
            and self.max_abs_error > self.tolerance.absolute and not self.error
            and not (self.integers_exact and self.integer_error)
        )

    def describe(self) -> str:
        integers = (
            f"; integer outputs differ by up to {self.integer_error:.3g} (they must match exactly)"
            if self.integers_exact and self.integer_error else ""
        )
        against = "" if self.reference == "the eager model" else f" against {self.reference}"
        besides = "".join(
            f"; {what} error ({against_what}) {error:.3g}"
            for what, against_what, error in (
                ("quantization", "against the float model", self.quantization_error),
                ("precision", "against the model as given", self.precision_error),
            )
            if error is not None
        )
        sizes = f"; also at {', '.join(self.sizes)}" if self.sizes else ""
        sizes += f" (the errors are at {self.worst_at})" if self.worst_at else ""
        failed = f"; failed {self.error}" if self.error else ""
        own = self.max_abs_error <= self.tolerance.absolute and not failed and not integers
        # The verdict follows the error it is judged on; the relative error is said after it, for
        # information (it is large wherever an output is near zero).
        line = (
            f"check{against}: {self.outputs} output(s), max abs error {self.max_abs_error:.3g} -> "
            f"{'OK' if own else 'over its float16 tolerance' if self.judged_at_float32 else 'MISMATCH'} "
            f"(tolerance {self.tolerance.absolute:.3g}, {self.tolerance.rule}{integers}); "
            f"max rel error {self.max_rel_error:.3g}{besides}{sizes}{failed}"
        )
        if self.float32_skipped is not None:
            return f"{line}\nthe same partitions converted computing in float32: not checked: {self.float32_skipped}"
        if self.at_float32 is None:
            return line
        again = f"{line}\nthe same partitions converted computing in float32: {self.at_float32.describe()}"
        if not self.judged_at_float32:
            return again
        return (
            f"{again}\njudged at float32: float16 rounding across the program's "
            f"{self.tolerance.activation_quantizers} requantizations moves its outputs by {self.max_abs_error:.3g}, "
            f"over the float16 tolerance {self.tolerance.absolute:.3g}, which allows each one step; computing in "
            f"float32 the same partitions are within theirs ({self.at_float32.max_abs_error:.3g} <= "
            f"{self.at_float32.tolerance.absolute:.3g}): float16 rounding is the cause, not the conversion"
        )

    def to_json(self) -> dict:
        """The check as JSON types, for the JSON report."""
        return {
            "passed": self.passed,
            "reference": self.reference,
            "outputs": self.outputs,
            "max_abs_error": self.max_abs_error,
            "max_rel_error": self.max_rel_error,
            "largest_expected": self.largest_expected,
            "tolerance": self.tolerance.absolute,
            "tolerance_kind": "relative" if self.tolerance.rule.startswith("relative") else "absolute",
            "tolerance_rule": self.tolerance.rule,
            "integer_error": self.integer_error,
            "integers_exact": self.integers_exact,
            "per_output": [{"max_abs_error": a, "max_rel_error": r} for a, r in self.output_errors],
            "quantization_error": self.quantization_error,
            "precision_error": self.precision_error,
            "sizes": list(self.sizes),
            "worst_at": self.worst_at,
            "error": self.error,
            "at_float32": None if self.at_float32 is None else self.at_float32.to_json(),
            "float32_skipped": self.float32_skipped,
            "judged_at_float32": self.judged_at_float32,
        }


def _tensors(outputs: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(outputs) if isinstance(x, torch.Tensor)]


def _least_precise(dtypes: Any) -> torch.dtype | None:
    """The floating dtype with the fewest significand bits among `dtypes` (None for none)."""
    floating = [d for d in dtypes if d is not None and d.is_floating_point]
    return max(floating, key=lambda d: torch.finfo(d).eps, default=None)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _model_dtype(module: Any, inputs: Sequence[Any]) -> torch.dtype:
    """The floating dtype an eager model computes in: its weights' least precise, else its inputs'."""
    held = [*module.parameters(), *module.buffers()] if isinstance(module, torch.nn.Module) else []
    return _least_precise(t.dtype for t in held) or _least_precise(t.dtype for t in _tensors(inputs)) or torch.float32


class _DtypesComputed(TorchDispatchMode):
    """Records the floating dtypes of the values an eager run computes: a float32 model computes
    an autocast region's matmul in bfloat16, and a delegate may compute it more precisely, so the
    check then allows bfloat16's rounding. Taken from the run itself, it is the same whichever
    path checks (a compile, a cache hit, `run` of a `.pte`)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        self.dtypes.update(t.dtype for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor))
        return result


def _eager_computing(module: Any, inputs: Sequence[Any]) -> tuple[list[torch.Tensor], torch.dtype | None]:
    """`_eager_writing`'s outputs, and the least precise floating dtype of any value it computed."""
    with _DtypesComputed() as computed, pages_released_as_it_runs(module):
        outputs = _eager_writing(module, inputs)
    return outputs, _least_precise(computed.dtypes)


def cast_copy(module: torch.nn.Module, inputs: Sequence[Any], dtype: torch.dtype) -> tuple[torch.nn.Module, tuple]:
    """A copy of the model and the inputs with every floating tensor in `dtype`."""
    import copy

    cast = pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tuple(inputs))
    # Weights the copy need not hold again: integer ones (quantized codes) are shared, and mapped
    # floating ones are cast into mapped files of their own (an 8B checkpoint is not read into memory).
    memo: dict[int, Any] = {}
    for param in module.parameters():
        if not param.is_floating_point():
            memo[id(param)] = param
        elif is_mapped(param):
            memo[id(param)] = torch.nn.Parameter(cast_into_file(param, dtype), requires_grad=False)
    copied = copy.deepcopy(module, memo)
    # Cast in place, not `.to(dtype)`, which puts new buffers in the module: state held elsewhere
    # too (a transformers static cache's layers hold its key and value tensors) would stay in the
    # old dtype and the two would no longer be one.
    for tensor in [*copied.parameters(), *copied.buffers()]:
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor.data = tensor.data.to(dtype)
    return copied, cast


@attrs.frozen
class EagerReference:
    """What a check compares a program with: `model`, the eager model the program computes (the
    eager quantized model of a program that quantized: `quantized`), and `widened(dtype)`, that
    model computing in the wider dtype the program computes in as the precision stage makes a
    program compute (its program, run eagerly: a cast module would still round through the casts
    inside it, and mix dtypes). The layers that run stages give `widened`
    (`CompileResult.eager_reference`); without it the model and its inputs are cast."""

    model: Any
    quantized: bool = False
    widened: Callable[[torch.dtype], torch.nn.Module] | None = None

    def in_dtype(self, inputs: Sequence[Any], dtype: torch.dtype) -> tuple[Any, tuple]:
        """The model computing in `dtype`, and the inputs it takes."""
        if self.widened is not None:
            return self.widened(dtype), tuple(inputs)
        return cast_copy(self.model, inputs, dtype)


def eager_reference(program: Any, module: torch.nn.Module) -> EagerReference:
    """The reference of a program checked against `module`: a CompileResult's own, made from its
    configuration whichever stages its run kept, else `module` itself."""
    make = getattr(program, "eager_reference", None)
    return make(module) if callable(make) else EagerReference(module)


def _max_error(actual: Sequence[Any], expected: Sequence[torch.Tensor]) -> float:
    pairs = [(got, want) for got, want in zip(actual, expected, strict=True) if want.numel()]
    return max((max_abs_error(got, want) for got, want in pairs), default=0.0)


def _eager(module: Any, inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Eager's outputs on a copy of `inputs`: a model that writes its inputs leaves them as given."""
    return _eager_writing(module, _cloned(inputs))


def _eager_writing(module: Any, inputs: Sequence[Any]) -> list[torch.Tensor]:
    with torch.no_grad():
        return _tensors(module(*inputs))


def _cloned(inputs: Sequence[Any]) -> tuple:
    return pytree.tree_map_only(torch.Tensor, torch.clone, tuple(inputs))


def _written_inputs_pairs(given: Sequence[Any], by_program: Sequence[Any], eager_given: Sequence[Any],
                          by_eager: Sequence[Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(program's, eager's) new value of each input either side wrote: a model that writes an
    input gives it to the user as it gives an output."""
    leaves = [pytree.tree_leaves(tuple(values)) for values in (given, by_program, eager_given, by_eager)]
    return [
        (got, want) for before, got, eager_before, want in zip(*leaves, strict=True)
        if isinstance(want, torch.Tensor) and not (torch.equal(before, got) and torch.equal(eager_before, want))
    ]


class _State:
    """The buffers of the models a check runs (a TorchAO quantized model shares the float
    model's): each run after the first starts where the first did, and the check leaves them
    as one run does, so a model that updates state in place (a cache) is compared as before."""

    def __init__(self, *modules: Any) -> None:
        held = {id(b): b for m in modules if isinstance(m, torch.nn.Module) for b in m.buffers()}
        self.buffers = list(held.values())
        self.before = [b.clone() for b in self.buffers]
        self.after: list[torch.Tensor] = []

    def first_run_done(self) -> None:
        self.after = [b.clone() for b in self.buffers]

    def _load(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for buffer, value in zip(self.buffers, values, strict=True):
                buffer.copy_(value)

    def rewind(self) -> None:
        self._load(self.before)

    def leave(self) -> None:
        self._load(self.after)


def _drawn_like(example: torch.Tensor, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A tensor of `shape` with values in the example's range (token ids stay ids, a mask of ones ones)."""
    low, high = (example.min(), example.max()) if example.numel() else (0, 1)
    if example.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if not example.is_floating_point():
        return torch.randint(int(low), int(high) + 1, shape, generator=generator, dtype=example.dtype)
    drawn = torch.rand(shape, generator=generator, dtype=torch.float32) * float(high - low) + float(low)
    return drawn.to(example.dtype)


def _inputs_at_range_ends(
    program: Any, inputs: Sequence[Any], module: torch.nn.Module, dynamic_shapes: Any
) -> list[tuple[str, tuple]]:
    """(what sizes, inputs) with every dynamic input size at the bottom of its declared range,
    then at the top, for a CompileResult whose program has them, or for another program (a `.pte`
    alone does not say which sizes are dynamic) with the `dynamic_shapes` given, the model exported
    with them; [] otherwise. New values are drawn in the example's range."""
    from torch.export import ExportedProgram

    from compiler.ir import dynamic

    stages = (getattr(program, "stages", None) or {}).values()
    exported = next((a.program for a in stages if isinstance(getattr(a, "program", None), ExportedProgram)), None)
    if exported is None and dynamic_shapes is not None:
        try:
            exported = torch.export.export(module, tuple(inputs), dynamic_shapes=dynamic_shapes, strict=False)
        except Exception as exc:  # torch.export's many errors: the sizes do not fit the model
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise UserInputError(
                f"the model does not export with the dynamic sizes given: {type(exc).__name__}: {first}",
                stage="capture", hint="give the dynamic sizes the program was compiled with",
            ) from exc
    ranges = dynamic.input_ranges(exported) if exported is not None else {}
    leaves, spec = pytree.tree_flatten(tuple(inputs))
    generator = torch.Generator().manual_seed(0)
    ends = []
    for end in (1, 2):
        values = {symbol: bounds[end] for symbol, bounds in ranges.items()}
        shapes = dynamic.input_shapes_at(exported, values) if values else []
        if len(shapes) != len(leaves) or all(
            shape is None or tuple(leaf.shape) == shape for leaf, shape in zip(leaves, shapes)
        ):
            continue
        drawn = [
            _drawn_like(leaf, shape, generator) if shape is not None and tuple(leaf.shape) != shape else leaf
            for leaf, shape in zip(leaves, shapes)
        ]
        label = ", ".join(f"{where} = {values[symbol]}" for symbol, (where, _, _) in ranges.items())
        ends.append((label, tuple(pytree.tree_unflatten(drawn, spec))))
    return ends


def _worse(one: CheckResult, other: CheckResult) -> bool:
    """Whether `one` is the worse result: failed where `other` passed, or further over its tolerance."""
    if one.passed != other.passed:
        return not one.passed
    return one.max_abs_error / max(one.tolerance.absolute, 1e-30) > other.max_abs_error / max(other.tolerance.absolute, 1e-30)


def compare_with_eager(
    program: Any, module: torch.nn.Module, inputs: Sequence[Any], tolerance: float | None = None,
    dynamic_shapes: Any = None, weights: str | os.PathLike | None = None, reference: EagerReference | None = None,
) -> CheckResult:
    """`compare_at` on the example inputs (`weights`: the program's data file, when not beside it); a CompileResult whose program has dynamic input sizes
    also runs with them all at the bottom of their declared ranges, then at the top (where a
    size a dependency fixed, or memory planned too small, shows), and the worst run is the
    result. A CompileResult whose Core ML delegates compute in float16 is also lowered again
    computing in float32 and checked at float32's tolerance (`at_float32`): float16's tolerance
    would hide a conversion fault smaller than its noise. The model's state is left as after
    the example's run. A `.pte` does not say which of its sizes are dynamic: `dynamic_shapes` (as
    torch.export takes them, those it was compiled with) give the ranges whose ends it runs at.
    `reference`: what the program is compared with (default: `eager_reference(program, module)`)."""
    reference = reference or eager_reference(program, module)
    state = _State(module)
    checked = _compare_over_ranges(program, module, inputs, tolerance, reference, dynamic_shapes, weights)
    remake = getattr(program, "at_float32", None)
    try:
        variant = remake() if callable(remake) and not checked.error else None
    except InsufficientMemory as exc:  # the float16 check stands; it says what it could not add
        return attrs.evolve(checked, float32_skipped=exc.reason)
    if variant is None:
        return checked
    state.first_run_done()
    state.rewind()
    try:
        return attrs.evolve(checked, at_float32=_compare_over_ranges(variant, module, inputs, tolerance, reference))
    finally:
        state.leave()


def _compare_over_ranges(
    program: Any, module: torch.nn.Module, inputs: Sequence[Any], tolerance: float | None, reference: EagerReference,
    dynamic_shapes: Any = None, weights: str | os.PathLike | None = None,
) -> CheckResult:
    checked = compare_at(program, module, inputs, tolerance, weights, reference)
    ends = _inputs_at_range_ends(program, inputs, module, dynamic_shapes)
    if not ends:
        return checked
    sizes = tuple(label for label, _ in ends)
    state = _State(module)
    worst, worst_at = checked, None
    try:
        for label, other in ends:
            try:
                result = compare_at(program, module, other, tolerance, weights, reference)
            except Exception as exc:  # the runtime, the reference executor or the shapes: the program fails there
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                return attrs.evolve(checked, sizes=sizes, error=f"at {label}: {type(exc).__name__}: {first}")
            if _worse(result, worst):
                worst, worst_at = result, label
    finally:
        state.rewind()
    return attrs.evolve(worst, sizes=sizes, worst_at=worst_at)


def compare_at(
    program: Any, module: torch.nn.Module, inputs: Sequence[Any], tolerance: float | None = None,
    weights: str | os.PathLike | None = None, reference: EagerReference | None = None,
) -> CheckResult:
    """Run the program (a CompileResult, `.pte` bytes or path) and eager PyTorch on the same
    inputs; report the largest errors against `tolerance` (absolute, for every output), or by
    default against one that fits what the program computes (`default_tolerance`, plus what
    a step of each quantized activation does: `activation_steps`) for floating-point outputs,
    and exact integer outputs.

    The reference is what the program computes (`reference`, default `eager_reference`): for a
    program that quantized, the eager quantized model, the error against `module` reported as
    the quantization error; for a program computing in a more precise floating dtype than the
    model (a bfloat16 model the precision stage computes in float32), the model computing in it,
    the error against the model as given reported as the precision error."""
    reference = reference or eager_reference(program, module)
    loaded = LoadedProgram(program, weights)
    run_on = _cloned(inputs)  # each side writes its own copy of inputs the model writes
    actual = loaded(run_on)
    loaded.release()  # before the eager runs: the two are never held at once
    model = reference.model
    model_dtype = _model_dtype(model, inputs)
    wider = wider_dtype(loaded.computes_in, model_dtype, loaded.delegate_dtypes_unknown)
    compared, compared_inputs = (model, tuple(inputs)) if wider is None else reference.in_dtype(inputs, wider)
    state = _State(compared, module, model)
    written_by_eager = _cloned(compared_inputs)
    expected, eager_computes_in = _eager_computing(compared, written_by_eager)
    state.first_run_done()
    if len(actual) != len(expected):
        raise UserInputError(
            f"the program returned {len(actual)} outputs, eager returned {len(expected)}",
            hint="compare the module the program was compiled from",
        )
    max_abs = max_rel = largest = integer_error = 0.0
    per_output = []
    written = _written_inputs_pairs(inputs, run_on, compared_inputs, written_by_eager)
    for got, want in [*zip(actual, expected, strict=True), *written]:
        floating = want.is_floating_point() or want.is_complex()
        if got.shape != want.shape:
            raise UserInputError(f"output shape {tuple(got.shape)} differs from eager {tuple(want.shape)}")
        diff = abs_error(got, want)
        want = want.to(diff.dtype)
        output_abs = output_rel = 0.0
        if diff.numel():
            output_abs, output_rel = diff.max().item(), (diff / want.abs().clamp_min(1e-6)).max().item()
            max_abs, max_rel = max(max_abs, output_abs), max(max_rel, output_rel)
            if floating:
                largest = max(largest, largest_finite(want))
            else:
                integer_error = max(integer_error, diff.max().item())
        per_output.append((output_abs, output_rel))
    chosen = (
        Tolerance.given(tolerance) if tolerance is not None
        else default_tolerance(loaded, wider or _least_precise([model_dtype, eager_computes_in]), actual, largest)
    )
    if tolerance is None and quantizes_activations(compared):
        steps = activation_steps(compared, compared_inputs, expected, state.rewind)
        chosen = chosen.with_activation_steps(steps.deviation, steps.quantizers, (steps.smallest, steps.largest), steps.draws)
    besides = {}
    if reference.quantized and model is not module:
        state.rewind()
        besides["quantization_error"] = _max_error(actual, _eager(module, inputs))
    if wider is not None:
        state.rewind()
        besides["precision_error"] = _max_error(actual, _eager(model, inputs))
    state.leave()
    label = "the eager quantized model" if reference.quantized else "the eager model"
    return CheckResult(
        max_abs, max_rel, len(expected), largest, chosen, integer_error, tolerance is None,
        tuple(per_output[: len(expected)]),  # the written inputs' errors count in the largest ones
        reference=label if wider is None else f"{label} in {_dtype_name(wider)}", **besides,
    )


def wider_dtype(program_dtype: torch.dtype | None, model_dtype: torch.dtype, delegate_dtypes_unknown: bool) -> torch.dtype | None:
    """The dtype the program computes in where it is more precise than the model's (a bfloat16
    model the precision stage computes in float32): the check's reference is the model in it.
    None where the program computes as the model does, or where a delegate computes in a dtype of
    its own: pi0 in bfloat16 on MLX, whose few CPU kernels take float32, was compared with the
    model in float32 at float32's tolerance, and failed by bfloat16's rounding."""
    if program_dtype is None or delegate_dtypes_unknown:
        return None
    return program_dtype if torch.finfo(program_dtype).eps < torch.finfo(model_dtype).eps else None


def default_tolerance(loaded: LoadedProgram, model_dtype: torch.dtype, actual: Sequence[Any], largest: float) -> Tolerance:
    """The precision's tolerance (the least precise of the model's dtype, the program's and a
    delegate's compute precision), plus the rounding of outputs returned in a narrow dtype."""
    delegate = torch.float16 if loaded.computes_in_float16 else None
    compute = _least_precise([model_dtype, loaded.computes_in, delegate])
    chosen = Tolerance.for_precision(_dtype_name(compute), largest, by_delegate=compute == delegate)
    returned = _least_precise(t.dtype for t in actual if isinstance(t, torch.Tensor))
    if returned is not None:
        chosen = chosen.with_output_rounding(_dtype_name(returned), largest)
    return chosen
