"""A reference interpreter of the MIL program inside a Core ML delegate payload, in numpy.

The Core ML runtime exists only on Apple systems; the payload's MIL program, read back
with coremltools (`milproto.load`, weights from the package's weight file), is run here
op by op with the kernels of `mil_kernels.py`, written from the MIL op specification.
Each op's result is cast to the dtype the program declares for it, so a program
converted with float16 compute precision loses precision here as on the device (its
casts are explicit ops). State inputs (Core ML state, iOS 18) carry between runs of one
`MilInterpreter`.
"""

from __future__ import annotations

import json
import pathlib
import tempfile
from typing import Any, Mapping, Optional

import numpy as np

from compiler.backends.coreml import mil_kernels
from compiler.backends.coreml.payload import coreml_payloads
from compiler.ir.errors import CompileError

STAGE = "run"


class MilInterpreterError(CompileError):
    """The interpreter cannot run this MIL program (or these inputs)."""


class UnsupportedMilOp(MilInterpreterError):
    """A MIL op type the interpreter has no kernel for."""


def covered_ops() -> list[str]:
    """The MIL op types the interpreter runs, sorted (`const` and the state ops included)."""
    return sorted(set(mil_kernels.KERNELS) | {"const", "read_state", "coreml_update_state"})


def coverage_text() -> str:
    """The covered op list, for docs/backends.md (`python -m compiler.tools.readme`)."""
    ops = covered_ops()
    return f"The interpreter runs {len(ops)} MIL op types: " + ", ".join(f"`{op}`" for op in ops) + "."


def load_payload(payload: bytes) -> tuple[Any, dict]:
    """The coremltools MIL `Program` of one Core ML delegate payload (its weights loaded) and
    the payload's `metadata.json` (the input and output names in delegate-call order)."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load
    from executorch.backends.apple.coreml import executorchcoreml

    with tempfile.TemporaryDirectory() as folder:
        executorchcoreml.unflatten_directory_contents(payload, folder)
        package = next(pathlib.Path(folder).rglob("*.mlpackage"))
        metadata_file = package.parent / "metadata.json"
        metadata = json.loads(metadata_file.read_text()) if metadata_file.exists() else {}
        spec = ct.utils.load_spec(str(package))
        weights = package / "Data" / "com.apple.CoreML" / "weights"
        # Weights are read while loading (the blob reader keeps no file open after).
        return load(spec, spec.specificationVersion, file_weights_dir=str(weights)), metadata


def load_programs(pte: bytes) -> list[Any]:
    """The MIL programs of every Core ML delegate of a `.pte`, in execution-plan order."""
    return [load_payload(payload)[0] for payload in coreml_payloads(pte)]


def _np_dtype(var) -> np.dtype:
    from coremltools.converters.mil.mil import types

    return np.dtype(types.nptype_from_builtin(var.dtype))


def _is_state(var) -> bool:
    from coremltools.converters.mil.mil import types

    return types.is_state(var.sym_type)


def _static_shape(var) -> Optional[tuple[int, ...]]:
    shape = getattr(var, "shape", None)
    if shape is None or not all(isinstance(d, (int, np.integer)) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def _dropped_after(operations: Any, kept: list[str]) -> list[list[str]]:
    """For each op, the values no later op reads (the function's outputs apart): a run frees
    them there, so it holds the values live at once, not every weight it dequantized and every
    activation it made (a 3B model's float16 weights alone are 6 GB)."""
    last: dict[str, int] = {}
    for index, op in enumerate(operations):
        for var in op.outputs:
            last[var.name] = index
        for var in op.inputs.values():
            for read in var if isinstance(var, (list, tuple)) else (var,):
                last[read.name] = index
    dropped: list[list[str]] = [[] for _ in operations]
    for name, index in last.items():
        if name not in kept:
            dropped[index].append(name)
    return dropped


class MilInterpreter:
    """Runs the `main` function of one MIL program; `state` holds Core ML state by input name."""

    def __init__(self, program: Any, function: str = "main") -> None:
        self.program = program
        self.function = program.functions[function]
        self.state: dict[str, np.ndarray] = {}
        self.input_names = [n for n, v in self.function.inputs.items() if not _is_state(v)]
        self.state_names = [n for n, v in self.function.inputs.items() if _is_state(v)]
        self.output_names = [v.name for v in self.function.outputs]
        self.dropped_after = _dropped_after(self.function.operations, self.output_names)

    @property
    def computes_in_float16(self) -> bool:
        """Whether any value the program computes is float16 (its compute precision)."""
        return any(
            var.dtype is not None and _np_dtype(var) == np.float16
            for op in self.function.operations if op.op_type != "const"
            for var in op.outputs
        )

    def input_shape(self, name: str) -> Optional[tuple[int, ...]]:
        """The static shape the program declares for input `name` (None if symbolic or unknown)."""
        var = self.function.inputs.get(name)
        return None if var is None else _static_shape(var)

    def zero_state(self) -> dict[str, np.ndarray]:
        """Each state input at zero, as `MLModel.newState` allocates it."""
        state = {}
        for name in self.state_names:
            var = self.function.inputs[name]
            shape = _static_shape(var)
            if shape is None:
                raise MilInterpreterError(
                    f"MIL state input {name!r} has no static shape", stage=STAGE, nodes=[name]
                )
            state[name] = np.zeros(shape, dtype=_np_dtype(var))
        return state

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        env: dict[str, Any] = {}
        for name, var in self.function.inputs.items():
            if _is_state(var):
                if name not in self.state:
                    raise MilInterpreterError(
                        f"MIL state input {name!r} has no value",
                        stage=STAGE, nodes=[name],
                        hint="give its initial value in `state` (the delegate's mutable buffer)",
                    )
                env[name] = self.state[name]
                continue
            if name not in inputs:
                raise MilInterpreterError(
                    f"MIL input {name!r} is not given (inputs: {sorted(inputs)})",
                    stage=STAGE, nodes=[name], hint=f"give every input of {self.input_names}",
                )
            env[name] = self._check(var, np.asarray(inputs[name]), f"input {name!r}", cast=True)
        for op, dropped in zip(self.function.operations, self.dropped_after):
            self._run_op(op, env)
            for name in dropped:
                env.pop(name, None)
        return {name: env[name] for name in self.output_names}

    def _run_op(self, op: Any, env: dict[str, Any]) -> None:
        if op.op_type == "const":
            env[op.outputs[0].name] = op.outputs[0].val
            return
        args = {
            name: [env[v.name] for v in var] if isinstance(var, (list, tuple)) else env[var.name]
            for name, var in op.inputs.items()
        }
        if op.op_type == "read_state":
            results = (np.array(args["input"], copy=True),)
        elif op.op_type == "coreml_update_state":
            state_name = op.inputs["state"].name
            value = self._check(op.outputs[0], np.asarray(args["value"]), f"op {op.name!r}")
            self.state[state_name] = env[state_name] = np.array(value, copy=True)
            results = (value,)
        else:
            kernel = mil_kernels.KERNELS.get(op.op_type)
            if kernel is None:
                raise UnsupportedMilOp(
                    f"MIL op type {op.op_type!r} (op {op.name!r}) has no kernel in the Core ML "
                    "reference interpreter",
                    stage=STAGE, nodes=[op.name],
                    hint="add a kernel written from coremltools' mil/ops/defs to "
                    "compiler/backends/coreml/mil_kernels.py, or keep the op on the CPU",
                )
            try:
                results = kernel(**args)
            except (ValueError, IndexError, TypeError) as exc:
                shapes = {k: np.shape(v) for k, v in args.items() if not isinstance(v, list)}
                raise MilInterpreterError(
                    f"MIL op {op.name!r} ({op.op_type}) cannot run on its operands {shapes}: "
                    f"{str(exc).strip().splitlines()[0]}",
                    stage=STAGE, nodes=[op.name],
                    hint="the MIL program is malformed here (a device would refuse or misread it); "
                    "keep the torch op that made it on the CPU",
                ) from exc
            if not isinstance(results, tuple):
                results = (results,)
        if len(results) != len(op.outputs):
            raise MilInterpreterError(
                f"kernel of {op.op_type!r} gave {len(results)} outputs, the op has {len(op.outputs)}",
                stage=STAGE, nodes=[op.name],
            )
        for var, value in zip(op.outputs, results):
            env[var.name] = self._check(var, np.asarray(value), f"op {op.name!r} ({op.op_type})")

    @staticmethod
    def _check(var: Any, value: np.ndarray, what: str, cast: bool = False) -> np.ndarray:
        """`value` in the dtype `var` declares; its shape must match the declared one."""
        dtype = _np_dtype(var)
        kinds = {"f": "f", "i": "iu", "u": "iu", "b": "b"}
        if not cast and value.dtype.kind not in kinds.get(dtype.kind, dtype.kind):
            raise MilInterpreterError(
                f"{what} computed {value.dtype}, the program declares {dtype}",
                stage=STAGE, nodes=[var.name],
            )
        shape = _static_shape(var)
        if shape is not None and tuple(value.shape) != shape:
            raise MilInterpreterError(
                f"{what} has shape {tuple(value.shape)}, the program declares {shape}",
                stage=STAGE, nodes=[var.name],
            )
        return value.astype(dtype, copy=False)
