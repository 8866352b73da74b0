"""Runs one MLX delegate payload with `mlx.core`, node by node.

A payload is a 24-byte header (4 zero bytes, the magic `MLX0`, the offset
and size of a data segment) and a FlatBuffer `MLXGraph` (ExecuTorch's
`backends/mlx/serialization/schema.fbs`): tensor slots (Tid) and scalar
value slots (Vid), instruction chains, the slots that are the payload's
inputs and outputs, and named slots whose data is in the program's named
data (the constants). The node tables are read with the FlatBuffer bindings
generated from that schema, field by field, as `_generated_inspector`
describes them; each node type then has a small function here that does
what the MLX runtime does for it. A node type without one fails with
`UnsupportedMLXNode` naming it.
"""

from __future__ import annotations

import importlib
import math
import struct
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import mlx.core as mx
import numpy as np
import torch

from compiler.ir.errors import CompileError

_HEADER = 24
_MAGIC = b"MLX0"
_GENERATED = "executorch.backends.mlx.serialization._generated.mlx_delegate"

# Slot types of `SlotVariant` (schema enum SlotType).
TENSOR_SLOT, INT_SLOT, FLOAT_SLOT, BOOL_SLOT = 0, 1, 2, 3


class UnsupportedMLXNode(CompileError):
    """An MLX payload holds a node type the reference executor cannot run."""


class BadMLXPayload(CompileError):
    """A delegate payload is not a readable MLX graph."""


class Tid(NamedTuple):
    idx: int


class Vid(NamedTuple):
    idx: int


# ExecuTorch ScalarType values (runtime/core/portable_type/scalar_type.h).
_SCALAR_TYPES: dict[int, tuple[Any, torch.dtype]] = {
    0: (mx.uint8, torch.uint8),
    1: (mx.int8, torch.int8),
    2: (mx.int16, torch.int16),
    3: (mx.int32, torch.int32),
    4: (mx.int64, torch.int64),
    5: (mx.float16, torch.float16),
    6: (mx.float32, torch.float32),
    7: (mx.float64, torch.float64),
    11: (mx.bool_, torch.bool),
    15: (mx.bfloat16, torch.bfloat16),
    27: (mx.uint16, torch.uint16),
    28: (mx.uint32, torch.uint32),
    29: (mx.uint64, torch.uint64),
}
_TORCH_TO_MX = {t: m for m, t in _SCALAR_TYPES.values()}


def mx_dtype(scalar_type: int):
    try:
        return _SCALAR_TYPES[scalar_type][0]
    except KeyError:
        raise BadMLXPayload(f"MLX payload uses ExecuTorch scalar type {scalar_type}, unknown here") from None


def to_mx(tensor: torch.Tensor) -> mx.array:
    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return mx.array(tensor.view(torch.uint16).numpy()).view(mx.bfloat16)
    return mx.array(tensor.numpy())


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
        from executorch.backends.mlx._generated_inspector import OP_NODE_FIELDS

        op_node = importlib.import_module(f"{_GENERATED}.OpNode").OpNode
        self.node_names = {
            value: name for name, value in vars(op_node).items() if isinstance(value, int) and name != "NONE"
        }
        self.fields = OP_NODE_FIELDS
        self._classes: dict[str, type] = {}

    def node_class(self, name: str) -> type:
        if name not in self._classes:
            self._classes[name] = getattr(importlib.import_module(f"{_GENERATED}.{name}"), name)
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
                hint="was the program compiled with --backend mlx by this ExecuTorch?",
            )
        data_offset = struct.unpack("<Q", payload[8:16])[0]
        graph_class = importlib.import_module(f"{_GENERATED}.MLXGraph").MLXGraph
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
    """Tensor slots hold `mx.array`s, value slots Python scalars."""

    def __init__(self, graph: MLXGraph, named_data: Mapping[str, bytes]) -> None:
        self.graph = graph
        self.tensors: dict[int, mx.array] = {}
        self.values: dict[int, int | float | bool] = {}
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

    # Operand access for node functions.
    def t(self, ref: Tid | None) -> mx.array | None:
        if ref is None:
            return None
        try:
            return self.tensors[ref.idx]
        except KeyError:
            raise BadMLXPayload(f"the MLX payload reads tensor slot {ref.idx} before writing it") from None

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
        for node in self.graph.chains[index]:
            function = NODE_FUNCTIONS.get(node.kind)
            if function is None:
                raise UnsupportedMLXNode(
                    f"the MLX reference executor cannot run payload node type {node.kind}",
                    nodes=[node.kind],
                    hint="add it to NODE_FUNCTIONS in compiler/backends/mlx/interpreter.py, "
                    "or run the program on Apple silicon with ExecuTorch's MLX runtime",
                )
            function(self, node.fields)

    def execute(self, inputs: Sequence[Any]) -> list[Any]:
        if len(inputs) != len(self.graph.inputs):
            raise BadMLXPayload(
                f"the MLX payload takes {len(self.graph.inputs)} inputs, the program passed {len(inputs)}"
            )
        for (idx, slot_type), value in zip(self.graph.inputs, inputs):
            if slot_type == TENSOR_SLOT:
                self.tensors[idx] = to_mx(value) if isinstance(value, torch.Tensor) else value
            else:
                self.values[idx] = value.item() if isinstance(value, torch.Tensor) else value
        self.run_chain(self.graph.main_chain)
        outputs = []
        for idx, slot_type in self.graph.outputs:
            if slot_type == TENSOR_SLOT:
                outputs.append(to_torch(self.t(Tid(idx))))
            else:
                outputs.append(self.values[idx])
        return outputs


def _constant(data: bytes, spec: TensorSpec) -> mx.array:
    dtype = _SCALAR_TYPES.get(spec.scalar_type)
    if dtype is None:
        raise BadMLXPayload(f"MLX constant of ExecuTorch scalar type {spec.scalar_type} is unknown here")
    torch_dtype = dtype[1]
    count = math.prod(spec.shape)
    tensor = torch.frombuffer(bytearray(data), dtype=torch_dtype, count=count).reshape(spec.shape)
    return to_mx(tensor)


# --- what each node does (as the MLX runtime does it) ---------------------------------

NodeFunction = Callable[[Interpreter, dict], None]
NODE_FUNCTIONS: dict[str, NodeFunction] = {}


def node(*kinds: str):
    def register(function: NodeFunction) -> NodeFunction:
        for kind in kinds:
            NODE_FUNCTIONS[kind] = function
        return function

    return register


def _unary(kind: str, function: Callable[[mx.array], mx.array]) -> None:
    NODE_FUNCTIONS[kind] = lambda it, f: it.set(f["out"], function(it.t(f["x"])))


def _binary(kind: str, function: Callable[[mx.array, mx.array], mx.array]) -> None:
    NODE_FUNCTIONS[kind] = lambda it, f: it.set(f["out"], function(it.t(f["a"]), it.t(f["b"])))


def _int_binary(kind: str, function: Callable[[int, int], int]) -> None:
    NODE_FUNCTIONS[kind] = lambda it, f: it.set(f["out"], function(it.v(f["a"]), it.v(f["b"])))


def _gelu(x: mx.array, approximate: str | None) -> mx.array:
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + mx.tanh(inner))
    return 0.5 * x * (1.0 + mx.erf(x / math.sqrt(2.0)))


for _kind, _function in {
    "SiluNode": lambda x: x * mx.sigmoid(x),
    "SigmoidNode": mx.sigmoid,
    "TanhNode": mx.tanh,
    "RsqrtNode": mx.rsqrt,
    "SqrtNode": mx.sqrt,
    "LogNode": mx.log,
    "Log2Node": mx.log2,
    "Log10Node": mx.log10,
    "Log1pNode": mx.log1p,
    "ExpNode": mx.exp,
    "Expm1Node": mx.expm1,
    "SinNode": mx.sin,
    "CosNode": mx.cos,
    "TanNode": mx.tan,
    "ArcsinNode": mx.arcsin,
    "ArccosNode": mx.arccos,
    "ArctanNode": mx.arctan,
    "SinhNode": mx.sinh,
    "CoshNode": mx.cosh,
    "ArcsinhNode": mx.arcsinh,
    "ArccoshNode": mx.arccosh,
    "ArctanhNode": mx.arctanh,
    "ErfNode": mx.erf,
    "FloorNode": mx.floor,
    "CeilNode": mx.ceil,
    "SquareNode": mx.square,
    "ReciprocalNode": mx.reciprocal,
    "AbsNode": mx.abs,
    "NegNode": mx.negative,
    "SignNode": mx.sign,
    "LogicalNotNode": mx.logical_not,
    "BitwiseInvertNode": mx.bitwise_invert,
    "TruncNode": lambda x: mx.where(x < 0, mx.ceil(x), mx.floor(x)),
    "IdCopyNode": lambda x: x,
    "ContiguousNode": mx.contiguous,
}.items():
    _unary(_kind, _function)

for _kind, _function in {
    "AddNode": mx.add,
    "SubtractNode": mx.subtract,
    "MultiplyNode": mx.multiply,
    "DivideNode": mx.divide,
    "MaximumNode": mx.maximum,
    "MinimumNode": mx.minimum,
    "PowerNode": mx.power,
    "FloorDivideNode": mx.floor_divide,
    "RemainderNode": mx.remainder,
    "Atan2Node": mx.arctan2,
    "LogAddExpNode": mx.logaddexp,
    "LessNode": mx.less,
    "LessEqualNode": mx.less_equal,
    "GreaterNode": mx.greater,
    "GreaterEqualNode": mx.greater_equal,
    "EqualNode": mx.equal,
    "NotEqualNode": mx.not_equal,
    "LogicalAndNode": mx.logical_and,
    "LogicalOrNode": mx.logical_or,
    "BitwiseAndNode": mx.bitwise_and,
    "BitwiseOrNode": mx.bitwise_or,
    "BitwiseXorNode": mx.bitwise_xor,
}.items():
    _binary(_kind, _function)

for _kind, _function in {
    "AddIntNode": lambda a, b: a + b,
    "SubtractIntNode": lambda a, b: a - b,
    "MultiplyIntNode": lambda a, b: a * b,
    "FloorDivideIntNode": lambda a, b: a // b,
    "ModIntNode": lambda a, b: a % b,
}.items():
    _int_binary(_kind, _function)


def _reduction(kind: str, function) -> None:
    def run(it: Interpreter, f: dict) -> None:
        x = it.t(f["x"])
        axes = list(f["axes"]) or list(range(x.ndim))
        it.set(f["out"], function(x, axis=axes, keepdims=bool(f["keepdims"])))

    NODE_FUNCTIONS[kind] = run


for _kind, _function in {
    "SumNode": mx.sum,
    "MeanNode": mx.mean,
    "ProdNode": mx.prod,
    "MaxNode": mx.max,
    "MinNode": mx.min,
    "AnyNode": mx.any,
    "AllNode": mx.all,
    "LogSumExpNode": mx.logsumexp,
}.items():
    _reduction(_kind, _function)


@node("NoopNode")
def _noop(it: Interpreter, f: dict) -> None:
    pass


@node("AddmmNode")
def _addmm(it: Interpreter, f: dict) -> None:
    product = it.t(f["mat1"]) @ it.t(f["mat2"])
    if f["alpha"] != 1.0:
        product = product * f["alpha"]
    bias = it.t(f["bias"])
    if bias is not None:
        product = product + (bias * f["beta"] if f["beta"] != 1.0 else bias)
    it.set(f["out"], product)


@node("GeluNode")
def _gelu_node(it: Interpreter, f: dict) -> None:
    it.set(f["out"], _gelu(it.t(f["x"]), f["approximate"]))


@node("LayerNormNode")
def _layer_norm(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.fast.layer_norm(it.t(f["x"]), it.t(f["weight"]), it.t(f["bias"]), f["eps"]))


@node("RMSNormNode")
def _rms_norm(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.fast.rms_norm(it.t(f["x"]), it.t(f["weight"]), f["eps"]))


@node("SdpaNode")
def _sdpa(it: Interpreter, f: dict) -> None:
    mask = it.t(f["mask"])
    if mask is None and f["causal"]:
        mask = "causal"
    out = mx.fast.scaled_dot_product_attention(
        it.t(f["q"]), it.t(f["k"]), it.t(f["v"]), scale=f["scale"], mask=mask
    )
    it.set(f["out"], out)


@node("SoftmaxNode")
def _softmax(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.softmax(it.t(f["x"]), axis=f["axis"], precise=bool(f["precise"])))


@node("TransposeNode")
def _transpose(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.transpose(it.t(f["x"]), list(f["perm"])))


@node("ReshapeNode")
def _reshape(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.reshape(it.t(f["x"]), it.vs(f["shape"])))


@node("BroadcastToNode")
def _broadcast_to(it: Interpreter, f: dict) -> None:
    x = it.t(f["x"])
    shape = [x.shape[i - (len(f["shape"]) - x.ndim)] if s == -1 else s for i, s in enumerate(it.vs(f["shape"]))]
    it.set(f["out"], mx.broadcast_to(x, shape))


@node("ExpandDimsNode")
def _expand_dims(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.expand_dims(it.t(f["x"]), f["axis"]))


@node("SqueezeNode")
def _squeeze(it: Interpreter, f: dict) -> None:
    x = it.t(f["x"])
    dims = [d for d in f["dims"] if x.shape[d] == 1] if f["dims"] else None
    it.set(f["out"], mx.squeeze(x, dims) if dims != [] else x)


@node("TileNode")
def _tile(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.tile(it.t(f["x"]), it.vs(f["reps"])))


@node("RepeatNode")
def _repeat(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.repeat(it.t(f["x"]), it.v(f["repeats"]), axis=f["axis"]))


@node("FlipNode")
def _flip(it: Interpreter, f: dict) -> None:
    x = it.t(f["x"])
    index = [slice(None)] * x.ndim
    for axis in f["axes"]:
        index[axis] = slice(None, None, -1)
    it.set(f["out"], x[tuple(index)])


@node("RollNode")
def _roll(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.roll(it.t(f["x"]), it.vs(f["shift"]), axis=list(f["axes"])))


@node("SplitNode")
def _split(it: Interpreter, f: dict) -> None:
    x = it.t(f["x"])
    axis = f["axis"] % x.ndim
    sizes = it.vs(f["sizes"])
    outs = f["outs"]
    if len(sizes) == 1 and len(outs) > 1:  # one chunk size: the last chunk may be shorter
        sizes = [min(sizes[0], x.shape[axis] - sizes[0] * i) for i in range(len(outs))]
    boundaries = list(np.cumsum(sizes)[:-1])
    for ref, part in zip(outs, mx.split(x, [int(b) for b in boundaries], axis=axis)):
        it.set(ref, part)


def _axis_slice(it: "Interpreter", f: dict, x) -> tuple:
    """The index of a slice node's start:stop:step along its axis, clamped like torch."""
    axis = it.v(f["axis"]) % x.ndim
    size = x.shape[axis]
    start, stop = it.v(f["start"]), it.v(f["stop"])
    start = max(0, min(size, start + size if start < 0 else start))
    stop = max(0, min(size, stop + size if stop < 0 else stop))
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, stop, f["step"] or 1)
    return tuple(index)


@node("SliceNode")
def _slice(it: Interpreter, f: dict) -> None:
    x = it.t(f["x"])
    it.set(f["out"], x[_axis_slice(it, f, x)])


@node("SliceUpdateNode")
def _slice_update(it: Interpreter, f: dict) -> None:
    dst = it.t(f["dst"])
    out = mx.array(dst)
    out[_axis_slice(it, f, dst)] = it.t(f["update"])
    it.set(f["out"], out)


@node("ConcatenateNode")
def _concatenate(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.concatenate([it.t(t) for t in f["tensors"]], axis=f["axis"]))


@node("StackNode")
def _stack(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.stack([it.t(t) for t in f["tensors"]], axis=f["axis"]))


@node("AsTypeNode")
def _astype(it: Interpreter, f: dict) -> None:
    it.set(f["out"], it.t(f["x"]).astype(mx_dtype(f["scalar_type"])))


@node("FullNode")
def _full(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.full(it.vs(f["shape"]), it.v(f["v"]), dtype=mx_dtype(f["scalar_type"])))


@node("FullLikeNode")
def _full_like(it: Interpreter, f: dict) -> None:
    x = it.t(f["x"])
    dtype = x.dtype if f["scalar_type"] is None else mx_dtype(f["scalar_type"])
    it.set(f["out"], mx.full(x.shape, it.v(f["v"]), dtype=dtype))


@node("ARangeNode")
def _arange(it: Interpreter, f: dict) -> None:
    dtype = mx.int64 if f["scalar_type"] is None else mx_dtype(f["scalar_type"])
    it.set(f["out"], mx.arange(it.v(f["start"]), it.v(f["stop"]), it.v(f["step"]), dtype=dtype))


@node("WhereNode")
def _where(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.where(it.t(f["condition"]), it.t(f["x"]), it.t(f["y"])))


@node("ClipNode")
def _clip(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.clip(it.t(f["x"]), it.t(f["a_min"]), it.t(f["a_max"])))


@node("TrilNode")
def _tril(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.tril(it.t(f["x"]), f["k"]))


@node("TriuNode")
def _triu(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.triu(it.t(f["x"]), f["k"]))


@node("CumsumNode")
def _cumsum(it: Interpreter, f: dict) -> None:
    out = mx.cumsum(it.t(f["x"]), axis=f["axis"], reverse=bool(f["reverse"]), inclusive=bool(f["inclusive"]))
    it.set(f["out"], out)


def _arg(function):
    def run(it: Interpreter, f: dict) -> None:
        it.set(f["out"], function(it.t(f["x"]), axis=f["axis"], keepdims=bool(f["keepdims"])))

    return run


NODE_FUNCTIONS["ArgmaxNode"] = _arg(mx.argmax)
NODE_FUNCTIONS["ArgminNode"] = _arg(mx.argmin)


def _moment(function):
    def run(it: Interpreter, f: dict) -> None:
        x = it.t(f["x"])
        axes = list(f["axes"]) or list(range(x.ndim))
        it.set(f["out"], function(x, axis=axes, keepdims=bool(f["keepdims"]), ddof=int(f["ddof"])))

    return run


NODE_FUNCTIONS["VarNode"] = _moment(mx.var)
NODE_FUNCTIONS["StdNode"] = _moment(mx.std)


@node("TakeNode")
def _take(it: Interpreter, f: dict) -> None:
    index = it.v(f["index"])
    x = it.t(f["x"])
    if isinstance(index, mx.array) and index.dtype == mx.bool_:
        # What the MLX runtime would do: mx.take refuses boolean indices.
        raise BadMLXPayload(
            "the MLX payload gathers with a boolean index, which the MLX runtime refuses "
            "([Gather] Boolean indices not supported)",
            hint="compile it with this driver: boolean indices stay on the CPU",
        )
    if isinstance(index, int):
        index = index + x.shape[f["axis"]] if index < 0 else index
    it.set(f["out"], mx.take(x, index, axis=f["axis"]))


@node("TakeAlongAxisNode")
def _take_along_axis(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.take_along_axis(it.t(f["x"]), it.t(f["indices"]), axis=f["axis"]))


@node("GatherNode")
def _gather(it: Interpreter, f: dict) -> None:
    """mlx::gather(x, indices, axes, slice_sizes): the output has the broadcast index
    shape, then one dimension per input dimension (1 on the indexed axes)."""
    x = it.t(f["x"])
    axes = [a % x.ndim for a in f["axes"]]
    indices = mx.broadcast_arrays(*[it.t(i) for i in f["indices"]])
    rest = [d for d in range(x.ndim) if d not in axes]
    moved = mx.transpose(x, axes + rest)
    gathered = moved[tuple(indices)]  # broadcast shape + the other axes in order
    sizes = list(f["slice_sizes"])
    for d in rest:
        if sizes[d] != x.shape[d]:
            gathered = mx.take(gathered, mx.arange(sizes[d]), axis=len(indices[0].shape) + rest.index(d))
    it.set(f["out"], mx.reshape(gathered, list(indices[0].shape) + sizes))


@node("ScatterAddNode")
def _scatter_add(it: Interpreter, f: dict) -> None:
    # torch.scatter_add semantics (what the handler lowers); done in torch for clarity.
    x, indices, updates = (to_torch(it.t(f[k])) for k in ("x", "indices", "updates"))
    it.set(f["out"], to_mx(torch.scatter_add(x, f["axis"], indices.long(), updates)))


@node("SymSizeNode")
def _sym_size(it: Interpreter, f: dict) -> None:
    it.set(f["out"], int(it.t(f["a"]).shape[f["dim"]]))


@node("ItemIntNode")
def _item_int(it: Interpreter, f: dict) -> None:
    it.set(f["out"], int(it.t(f["x"]).item()))


@node("IfNode")
def _if(it: Interpreter, f: dict) -> None:
    it.run_chain(f["then_chain_idx"] if it.v(f["cond"]) else f["else_chain_idx"])


@node("PadNode")
def _pad(it: Interpreter, f: dict) -> None:
    flat = it.vs(f["pad_width"])  # (before, after) per dimension, first dimension first
    pairs = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]
    mode = f["mode"] or "constant"
    x = it.t(f["x"])
    if mode == "constant":
        it.set(f["out"], mx.pad(x, pairs, mode="constant", constant_values=f["constant_value"] or 0))
    else:
        it.set(f["out"], mx.pad(x, pairs, mode=mode))
