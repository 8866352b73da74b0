"""Reading a Core ML delegate payload back: the MIL program the backend converted.

The Core ML runtime exists only on macOS, so on other machines what the
backend built is checked here, in the payload: the payload is a flattened
`model.mlpackage` folder, which coremltools reads back as a model spec.
"""

from __future__ import annotations

import pathlib
import tempfile
from typing import Iterator

import attrs

from compiler.private_api import deserialize_pte


BACKEND_ID = "CoreMLBackend"


@attrs.frozen
class MilOp:
    type: str
    name: str
    # Input name -> the constant's value, for inputs that are constants (e.g. gelu's mode).
    constants: dict = attrs.field(factory=dict)
    # Output names -> their dtype in Core ML's spelling (fp32, int32, bool...).
    outputs: dict = attrs.field(factory=dict)


@attrs.frozen
class CoreMLModel:
    """What a Core ML payload holds: its input/output names and the main function's ops."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    ops: tuple[MilOp, ...]
    specification_version: int

    def op_types(self) -> list[str]:
        return [op.type for op in self.ops]

    def ops_of_type(self, op_type: str) -> list[MilOp]:
        return [op for op in self.ops if op.type == op_type]


def _dtype_name(value_type) -> str:
    from coremltools.proto import MIL_pb2

    tensor = value_type.tensorType
    return MIL_pb2.DataType.Name(tensor.dataType).lower()


# MIL dtypes whose immediate values are stored as raw bytes, as numpy reads them.
_BYTES_DTYPES = {"float16": "float16", "int8": "int8", "uint8": "uint8", "int16": "int16", "uint16": "uint16"}


def _constant(value) -> object:
    imm = value.immediateValue
    tensor = imm.tensor
    for field in ("strings", "bools", "ints", "floats", "longInts", "doubles"):
        if tensor.HasField(field):
            values = list(getattr(tensor, field).values)
            return values[0] if len(values) == 1 else values
    if tensor.HasField("bytes"):
        import numpy as np
        from coremltools.proto import MIL_pb2

        dtype = _BYTES_DTYPES.get(MIL_pb2.DataType.Name(value.type.tensorType.dataType).lower())
        if dtype:
            values = np.frombuffer(tensor.bytes.values, dtype=dtype).tolist()
            return values[0] if len(values) == 1 else values
    return None


def read_model(payload: bytes) -> CoreMLModel:
    """Unpack one Core ML delegate payload and read its MIL program."""
    import coremltools as ct
    from executorch.backends.apple.coreml import executorchcoreml

    with tempfile.TemporaryDirectory() as folder:
        executorchcoreml.unflatten_directory_contents(payload, folder)
        package = next(pathlib.Path(folder).rglob("*.mlpackage"))
        spec = ct.utils.load_spec(str(package))
    function = spec.mlProgram.functions["main"]
    block = function.block_specializations[function.opset]
    ops = []
    for op in block.operations:
        constants = {}
        for name, argument in op.inputs.items():
            for binding in argument.arguments:
                if binding.HasField("value"):
                    constants[name] = _constant(binding.value)
        outputs = {out.name: _dtype_name(out.type) for out in op.outputs}
        ops.append(MilOp(op.type, op.attributes["name"].immediateValue.tensor.strings.values[0]
                         if "name" in op.attributes else "", constants, outputs))
    # Constants passed by name (const ops) are resolved into the ops that read them.
    const_values = {
        name: _constant(op.attributes["val"]) if "val" in op.attributes else None
        for op in block.operations
        if op.type == "const"
        for name in [o.name for o in op.outputs]
    }
    resolved = []
    for op, proto in zip(ops, block.operations):
        constants = dict(op.constants)
        for name, argument in proto.inputs.items():
            for binding in argument.arguments:
                if binding.HasField("name") and binding.name in const_values:
                    constants[name] = const_values[binding.name]
        resolved.append(attrs.evolve(op, constants=constants))
    return CoreMLModel(
        inputs=tuple(i.name for i in spec.description.input),
        outputs=tuple(o.name for o in spec.description.output),
        ops=tuple(resolved),
        specification_version=spec.specificationVersion,
    )


# MIL ops that compute f(x + epsilon) with a nonzero default epsilon (inverse 1e-4, rsqrt
# 1e-12, log 1e-45): no torch op means that, so in a payload each must say epsilon 0.
EPSILON_OPS = ("inverse", "rsqrt", "log")


def ops_adding_an_epsilon(model: CoreMLModel) -> list[str]:
    """The ops of `model` that add an epsilon to their input: a default left in, or a nonzero one."""
    found = []
    for op in model.ops:
        epsilon = op.constants.get("epsilon", "left at its default")
        if op.type in EPSILON_OPS and epsilon != 0:
            shown = f"{epsilon:.3g}" if isinstance(epsilon, float) else epsilon
            found.append(f"{op.name or op.type} ({op.type}, epsilon {shown})")
    return found


def coreml_payloads(pte: bytes) -> Iterator[bytes]:
    """The Core ML delegate payloads of a `.pte`, in execution-plan order."""
    program = deserialize_pte(pte).program
    for plan in program.execution_plan:
        for delegate in plan.delegates:
            if delegate.id != BACKEND_ID:
                continue
            data = delegate.processed
            if data.location.name == "INLINE" or int(data.location) == 0:
                yield bytes(program.backend_delegate_data[data.index].data)
            else:  # segment data (not written by the default emit config)
                raise NotImplementedError("Core ML payload stored in a segment")


def read_models(pte: bytes) -> list[CoreMLModel]:
    """Every Core ML model inside a `.pte`."""
    return [read_model(payload) for payload in coreml_payloads(pte)]
