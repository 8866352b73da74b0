"""Runs one MLX delegate payload with `mlx.core`, node by node.

A payload is a 24-byte header (4 zero bytes, the magic `MLX0`, the offset
and size of a data segment) and a FlatBuffer `MLXGraph` (ExecuTorch's
`backends/mlx/serialization/schema.fbs`): tensor slots (Tid) and scalar
value slots (Vid), instruction chains, the slots that are the payload's
inputs and outputs, and named slots whose data is in the program's named
data (the constants). The node tables are read with the FlatBuffer bindings
generated from that schema, field by field, as `_generated_inspector`
describes them; each node type then has a small function that does what the
MLX runtime (`backends/mlx/runtime/MLXInterpreter.h`) does for it. The
functions live in the `nodes_*` modules by concern and register themselves in
the one registry here, `NODE_FUNCTIONS`; the node types the reference
executor cannot run on this machine are listed, each with its reason, in
`UNSUPPORTED_NODES`. Any other node type without a function fails with
`UnsupportedMLXNode` naming it.

State follows the runtime's `ExecutionState`: constants (which the init chain
may write) and the delegate's mutable buffers live as long as the
`Interpreter`; inputs, outputs, temporaries and scalar values are dropped
before each call.
"""

from __future__ import annotations

import math
import struct
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import mlx.core as mx
import numpy as np
import torch

from compiler.ir.errors import CompileError
from compiler.ir.private_api import mlx_generated_class, mlx_op_node_fields

_HEADER = 24
_MAGIC = b"MLX0"

# Slot types of `SlotVariant` (schema enum SlotType).
TENSOR_SLOT, INT_SLOT, FLOAT_SLOT, BOOL_SLOT = 0, 1, 2, 3


class UnsupportedMLXNode(CompileError):
    """An MLX payload holds a node type the reference executor cannot run."""


class BadMLXPayload(CompileError):
    """A delegate payload is not a readable MLX graph."""


class MLXNodeFailure(CompileError):
    """A node fails here where the MLX runtime throws for it too (bad operands, no cache)."""


class Tid(NamedTuple):
    idx: int


class Vid(NamedTuple):
    idx: int


# ExecuTorch ScalarType values (runtime/core/portable_type/scalar_type.h) and the dtype each
# stands for, by its name: torch and MLX name their dtypes alike (but MLX's `bool_`), so one
# name per code keeps the two sides of `_SCALAR_TYPES` from disagreeing.
_SCALAR_TYPE_NAMES = {
    0: "uint8",
    1: "int8",
    2: "int16",
    3: "int32",
    4: "int64",
    5: "float16",
    6: "float32",
    7: "float64",
    11: "bool",
    15: "bfloat16",
    27: "uint16",
    28: "uint32",
    29: "uint64",
}
_SCALAR_TYPES: dict[int, tuple[Any, torch.dtype]] = {
    code: (getattr(mx, "bool_" if name == "bool" else name), getattr(torch, name))
    for code, name in _SCALAR_TYPE_NAMES.items()
}
_TORCH_TO_MX = {t: m for m, t in _SCALAR_TYPES.values()}


def mx_dtype(scalar_type: int):
    try:
        return _SCALAR_TYPES[scalar_type][0]
    except KeyError:
        raise BadMLXPayload(f"MLX payload uses ExecuTorch scalar type {scalar_type}, unknown here") from None


def to_mx(tensor: torch.Tensor) -> mx.array:
    """Same dtype as the tensor (mx.array alone would make a float64 array float32)."""
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return mx.array(tensor.view(torch.uint16).numpy()).view(mx.bfloat16)
    return mx.array(tensor.numpy(), dtype=_TORCH_TO_MX.get(tensor.dtype))


def to_torch(array: mx.array) -> torch.Tensor:
    if array.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(array.view(mx.uint16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(array))


# --- reading the FlatBuffer -----------------------------------------------------------


def _scalar_field(table, accessor: str) -> Any:
    return getattr(table, accessor)()


def _tid(table, accessor: str) -> Tid | None:
    value = getattr(table, accessor)()
    return None if value is None else Tid(value.Idx())


def _vid(table, accessor: str) -> Vid | None:
    value = getattr(table, accessor)()
    return None if value is None else Vid(value.Idx())


def _int_or_vid_value(item) -> int | float | Vid | None:
    if item is None:
        return None
    return Vid(item.Vid().Idx()) if item.IsVid() else item.Literal()


def _int_or_vid(table, accessor: str):
    return _int_or_vid_value(getattr(table, accessor)())


def _vid_or_tid(table, accessor: str):
    item = getattr(table, accessor)()
    if item is None:
        return None
    return Vid(item.Vid().Idx()) if item.IsVid() else Tid(item.Tid().Idx())


def _int_or_vid_or_tid(table, accessor: str):
    item = getattr(table, accessor)()
    if item is None:
        return None
    kind = item.Kind()
    if kind == 0:
        return item.Literal()
    if kind == 1:
        return Vid(item.Vid().Idx())
    return Tid(item.Tid().Idx())


def _list(read_item: Callable[[Any], Any]):
    def read(table, accessor: str) -> list:
        get = getattr(table, accessor)
        return [read_item(get(i)) for i in range(getattr(table, f"{accessor}Length")())]

    return read


def _string(table, accessor: str) -> str | None:
    value = getattr(table, accessor)()
    return value.decode() if value is not None else None


_FIELD_READERS: dict[str, Callable[[Any, str], Any]] = {
    "tid": _tid,
    "vid": _vid,
    "int_or_vid": _int_or_vid,
    "float_or_vid": _int_or_vid,
    "vid_or_tid": _vid_or_tid,
    "int_or_vid_or_tid": _int_or_vid_or_tid,
    "int_list": _list(lambda v: v),
    "tid_list": _list(lambda t: None if t is None else Tid(t.Idx())),
    "int_or_vid_list": _list(_int_or_vid_value),
    "string_list": _list(lambda s: s.decode() if s is not None else None),
    "string": _string,
    "scalar": _scalar_field,
}


class _Schema:
    """The generated node classes and field layouts, loaded once."""

    def __init__(self) -> None:
        op_node = mlx_generated_class("OpNode")
        self.node_names = {
            value: name for name, value in vars(op_node).items() if isinstance(value, int) and name != "NONE"
        }
        self.fields = mlx_op_node_fields()
        self._classes: dict[str, type] = {}

    def node_class(self, name: str) -> type:
        if name not in self._classes:
            self._classes[name] = mlx_generated_class(name)
        return self._classes[name]


_SCHEMA: _Schema | None = None


def _schema() -> _Schema:
    global _SCHEMA
    if _SCHEMA is None:
        _SCHEMA = _Schema()
    return _SCHEMA


class Node(NamedTuple):
    """One decoded instruction: its node type and its fields by schema name."""

    kind: str
    fields: dict[str, Any]


def _decode_instruction(instruction) -> Node:
    schema = _schema()
    op_type = instruction.OpType()
    kind = schema.node_names.get(op_type, f"<union member {op_type}>")
    layout = schema.fields.get(kind)
    if layout is None:
        raise UnsupportedMLXNode(
            f"the MLX payload holds node type {kind}, which this ExecuTorch's schema does not know",
            hint="the program was made by another ExecuTorch version; compile it with this one",
        )
    table = schema.node_class(kind)()
    op = instruction.Op()
    table.Init(op.Bytes, op.Pos)
    return Node(kind, {name: _FIELD_READERS[how](table, accessor) for name, accessor, how in layout})


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]  # -1 where the dimension is dynamic
    scalar_type: int | None


class MLXGraph:
    """A decoded payload: what the interpreter needs, read once per delegate."""

    def __init__(self, payload: bytes) -> None:
        if len(payload) < _HEADER or payload[4:8] != _MAGIC:
            raise BadMLXPayload(
                "the delegate payload is not an MLX graph (no MLX0 header)",
                hint="was the program compiled for the mlx backend by this ExecuTorch?",
            )
        data_offset = struct.unpack("<Q", payload[8:16])[0]
        graph_class = mlx_generated_class("MLXGraph")
        graph = graph_class.GetRootAs(payload[_HEADER:data_offset], 0)

        self.version = (graph.Version() or b"").decode()
        self.chains: list[list[Node]] = []
        for c in range(graph.InstructionChainsLength()):
            chain = graph.InstructionChains(c)
            self.chains.append(
                [_decode_instruction(chain.Instructions(i)) for i in range(chain.InstructionsLength())]
            )
        self.main_chain = graph.MainChainIdx()
        self.init_chain = graph.InitChainIdx()

        def slots(length: int, get) -> list[tuple[int, int]]:
            return [(get(i).Idx(), get(i).SlotType()) for i in range(length)]

        self.inputs = slots(graph.InputMapLength(), graph.InputMap)
        self.outputs = slots(graph.OutputMapLength(), graph.OutputMap)
        self.mutable_buffers = slots(graph.MutableBufferMapLength(), graph.MutableBufferMap)
        self.named_slots = {}
        for i in range(graph.NamedSlotsLength()):
            named = graph.NamedSlots(i)
            self.named_slots[named.Name().decode()] = (named.Slot().Idx(), named.Slot().SlotType())
        self.num_constants = graph.NumConstantTensors()
        self.tensor_specs: list[TensorSpec | None] = []
        for i in range(graph.TensorMetaLength()):
            meta = graph.TensorMeta(i)
            if meta is None:
                self.tensor_specs.append(None)
                continue
            shape = tuple(meta.Shape(j).Value() for j in range(meta.ShapeLength()))
            self.tensor_specs.append(TensorSpec(shape, meta.ScalarType()))

    def node_kinds(self) -> set[str]:
        return {node.kind for chain in self.chains for node in chain}


# --- running it -----------------------------------------------------------------------


class Interpreter:
    """Tensor slots hold `mx.array`s, value slots Python scalars.

    One per delegate, made once: like the runtime's handle, it keeps its
    constants and mutable buffers from call to call. `kv_cache` is the
    off-graph KV cache `UpdateAndAttendNode` reads and writes (the runtime gets
    it from the runner); an ExecuTorch reference cache
    (`executorch.extension.llm.cache.reference_cache`) or anything with its
    `update_and_fetch(layer_id, k, v, position)`.
    """

    def __init__(self, graph: MLXGraph, named_data: Mapping[str, bytes], kv_cache: Any = None) -> None:
        self.graph = graph
        self.kv_cache = kv_cache
        self.tensors: dict[int, mx.array] = {}
        self.values: dict[int, int | float | bool] = {}
        self._persistent = set(range(graph.num_constants)) | {idx for idx, _ in graph.mutable_buffers}
        for name, (idx, slot_type) in graph.named_slots.items():
            if slot_type != TENSOR_SLOT or name not in named_data:
                continue
            spec = graph.tensor_specs[idx] if idx < len(graph.tensor_specs) else None
            if spec is None or spec.scalar_type is None or -1 in spec.shape:
                raise BadMLXPayload(f"the MLX payload's constant {name!r} has no static shape and dtype")
            self.tensors[idx] = _constant(named_data[name], spec)
        for idx, slot_type in graph.mutable_buffers:
            # As the MLX runtime does (load_mutable_buffers): zeros, whatever the
            # buffer held when it was exported; its first value is not in the program.
            spec = graph.tensor_specs[idx]
            self.tensors[idx] = mx.zeros([max(d, 0) for d in spec.shape], dtype=mx_dtype(spec.scalar_type))
        if graph.init_chain >= 0:
            self.run_chain(graph.init_chain)

    def _reset(self) -> None:
        """What `ExecutionState::reset` does before a call: keep constants and mutable buffers."""
        self.tensors = {idx: array for idx, array in self.tensors.items() if idx in self._persistent}
        self.values = {}

    # Operand access for node functions.
    def t(self, ref: Tid | None) -> mx.array | None:
        if ref is None:
            return None
        try:
            return self.tensors[ref.idx]
        except KeyError:
            error = BadMLXPayload(f"the MLX payload reads tensor slot {ref.idx} before writing it")
            error.slot = ref.idx  # the slot no instruction wrote (compiler.locate names its node)
            raise error from None

    def v(self, ref):
        """An int/float literal, or the value a Vid holds."""
        if isinstance(ref, Vid):
            return self.values[ref.idx]
        if isinstance(ref, Tid):
            return self.t(ref)
        return ref

    def vs(self, refs: Sequence) -> list:
        return [self.v(r) for r in refs]

    def set(self, ref: Tid | Vid, value) -> None:
        if isinstance(ref, Vid):
            self.values[ref.idx] = value
        else:
            self.tensors[ref.idx] = value

    def run_chain(self, index: int) -> None:
        for position, node in enumerate(self.graph.chains[index]):
            try:
                self._run_node(node)
            except CompileError as error:
                # Where it failed: (chain, position in it, node kind), the outermost chain's
                # last (compiler.locate maps a main-chain position to the Edge node it came from).
                error.instruction = (index, position, node.kind)
                raise

    def _run_node(self, node: Node) -> None:
        function = NODE_FUNCTIONS.get(node.kind)
        if function is None and node.kind in UNSUPPORTED_NODES:
            raise UnsupportedMLXNode(
                f"the MLX reference executor cannot run payload node type {node.kind}: "
                f"{UNSUPPORTED_NODES[node.kind]}. This is a limit of the reference executor, "
                "not a fault of the program",
                nodes=[node.kind],
                hint="run the program on Apple silicon with ExecuTorch's MLX runtime",
            )
        if function is None:
            raise UnsupportedMLXNode(
                f"the MLX reference executor cannot run payload node type {node.kind}",
                nodes=[node.kind],
                hint="add a function for it to a compiler/backends/mlx/nodes_*.py module, "
                "or run the program on Apple silicon with ExecuTorch's MLX runtime",
            )
        try:
            function(self, node.fields)
        except (ValueError, RuntimeError, IndexError) as exc:  # what mlx raises where the runtime throws
            raise MLXNodeFailure(
                f"payload node {node.kind} failed as the MLX runtime would: {str(exc).strip().splitlines()[0]}",
                nodes=[node.kind],
                hint="the payload itself is wrong for the MLX runtime (a lowering bug): "
                "report it with the program; the device would fail the same way",
            ) from exc

    def execute(self, inputs: Sequence[Any]) -> list[Any]:
        if len(inputs) != len(self.graph.inputs):
            raise BadMLXPayload(
                f"the MLX payload takes {len(self.graph.inputs)} inputs, the program passed {len(inputs)}"
            )
        self._reset()
        for (idx, slot_type), value in zip(self.graph.inputs, inputs):
            if slot_type == TENSOR_SLOT:
                self.tensors[idx] = self._input_tensor(idx, value)
            else:
                self.values[idx] = _input_int(value.item() if isinstance(value, torch.Tensor) else value)
        self.run_chain(self.graph.main_chain)
        outputs = []
        for idx, slot_type in self.graph.outputs:
            if slot_type == TENSOR_SLOT:
                outputs.append(to_torch(self.t(Tid(idx))))
            else:
                outputs.append(self.values[idx])
        return outputs


    def _input_tensor(self, idx: int, value: Any) -> mx.array:
        """The runtime (tensor_to_mlx) refuses an input whose dtype is not the one the payload expects."""
        array = to_mx(value) if isinstance(value, torch.Tensor) else value
        spec = self.graph.tensor_specs[idx] if idx < len(self.graph.tensor_specs) else None
        if spec is not None and spec.scalar_type is not None and array.dtype != mx_dtype(spec.scalar_type):
            raise MLXNodeFailure(
                f"tensor_to_mlx: dtype mismatch - input tensor slot {idx} has {array.dtype} "
                f"but the MLX payload expects {mx_dtype(spec.scalar_type)}",
                hint="pass inputs of the dtypes the program was compiled with",
            )
        return array


def _input_int(value: Any) -> Any:
    """The runtime keeps int inputs in int32 and refuses the rest."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**31) <= value < 2**31:
        raise MLXNodeFailure(f"int input value {value} exceeds int32 range (the MLX runtime refuses it)")
    return value


def _constant(data: bytes, spec: TensorSpec) -> mx.array:
    dtype = _SCALAR_TYPES.get(spec.scalar_type)
    if dtype is None:
        raise BadMLXPayload(f"MLX constant of ExecuTorch scalar type {spec.scalar_type} is unknown here")
    torch_dtype = dtype[1]
    count = math.prod(spec.shape)
    if count == 0:  # torch.frombuffer refuses an empty buffer
        return mx.zeros(list(spec.shape), dtype=dtype[0])
    tensor = torch.frombuffer(bytearray(data), dtype=torch_dtype, count=count).reshape(spec.shape)
    return to_mx(tensor)


# --- the registry of node functions -----------------------------------------------------

NodeFunction = Callable[[Interpreter, dict], None]
NODE_FUNCTIONS: dict[str, NodeFunction] = {}

# Node types of the schema the reference executor refuses on purpose, each with why.
UNSUPPORTED_NODES: dict[str, str] = {
    "MetalKernelNode": "it runs a custom Metal kernel (Metal source in the payload), "
    "which needs an Apple GPU; the reference executor runs on the CPU (the stock MLX "
    "runtime, too, runs it only when built with ET_MLX_ALLOW_CUSTOM_KERNEL_EXECUTION)",
}


def node(*kinds: str):
    """Register a function for node types; each type has one function."""

    def register(function: NodeFunction) -> NodeFunction:
        for kind in kinds:
            if kind in NODE_FUNCTIONS:
                raise ValueError(f"MLX node type {kind} has two functions")
            NODE_FUNCTIONS[kind] = function
        return function

    return register


def supported_node_kinds() -> frozenset[str]:
    return frozenset(NODE_FUNCTIONS)


# The node functions register themselves on import; they need the names above.
from compiler.backends.mlx import nodes_attention, nodes_conv, nodes_core, nodes_quant  # noqa: E402,F401
