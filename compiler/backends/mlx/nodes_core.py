"""Node functions for the MLX payload's element-wise, reduction, shape, indexing,
sorting, random and control-flow node types.

Each does what `backends/mlx/runtime/MLXInterpreter.h` (`ops::exec_*`) does for
its node type, with `mlx.core` where the runtime calls `mlx::core`, so that a
payload the device would get wrong comes out wrong here too.
"""

from __future__ import annotations

import math
from typing import Callable

import mlx.core as mx
import numpy as np
import torch

from compiler.backends.mlx.interpreter import (
    BadMLXPayload,
    Interpreter,
    MLXNodeFailure,
    mx_dtype,
    node,
    to_mx,
    to_torch,
)

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _unary(kind: str, function: Callable[[mx.array], mx.array]) -> None:
    node(kind)(lambda it, f: it.set(f["out"], function(it.t(f["x"]))))


def _binary(kind: str, function: Callable[[mx.array, mx.array], mx.array]) -> None:
    node(kind)(lambda it, f: it.set(f["out"], function(it.t(f["a"]), it.t(f["b"]))))


def _int_binary(kind: str, function: Callable[[int, int], int]) -> None:
    """Scalar int math; the runtime computes in int64 and refuses results outside int32."""

    def run(it: Interpreter, f: dict) -> None:
        result = function(it.v(f["a"]), it.v(f["b"]))
        if not _INT32_MIN <= result <= _INT32_MAX:
            raise MLXNodeFailure(f"{kind}: overflow (the MLX runtime keeps scalar values in int32)")
        it.set(f["out"], result)

    node(kind)(run)


def _int_divisor(a: int, b: int) -> int:
    if b == 0:
        raise MLXNodeFailure("integer division by zero in the MLX payload (the runtime throws too)")
    return b


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
    "FloorDivideIntNode": lambda a, b: a // _int_divisor(a, b),
    "ModIntNode": lambda a, b: a % _int_divisor(a, b),
}.items():
    _int_binary(_kind, _function)


def _reduction(kind: str, function) -> None:
    def run(it: Interpreter, f: dict) -> None:
        x = it.t(f["x"])
        axes = list(f["axes"]) or list(range(x.ndim))
        it.set(f["out"], function(x, axis=axes, keepdims=bool(f["keepdims"])))

    node(kind)(run)


for _kind, _function in {
    "SumNode": mx.sum,
    "MeanNode": mx.mean,
    "ProdNode": mx.prod,
    "MaxNode": mx.max,
    "MinNode": mx.min,
    "AnyNode": mx.any,
    "AllNode": mx.all,
}.items():
    _reduction(_kind, _function)


@node("LogSumExpNode")
def _logsumexp(it: Interpreter, f: dict) -> None:
    """Unlike the other reductions, the runtime hands the axes over as they are:
    an empty list reduces nothing."""
    it.set(f["out"], mx.logsumexp(it.t(f["x"]), axis=list(f["axes"]), keepdims=bool(f["keepdims"])))


@node("FloorDivideNode")
def _floor_divide(it: Interpreter, f: dict) -> None:
    """Floats: mx.floor_divide. Integers: the runtime's own fix-up of a truncating
    division, built on mx.divide, which makes floats: the result is float32."""
    a, b = it.t(f["a"]), it.t(f["b"])
    if mx.issubdtype(a.dtype, mx.inexact):
        it.set(f["out"], mx.floor_divide(a, b))
        return
    zero = mx.array(0, dtype=a.dtype)
    has_remainder = mx.not_equal(mx.remainder(a, b), zero)
    signs_differ = mx.not_equal(mx.less(a, zero), mx.less(b, zero))
    adjust = mx.logical_and(has_remainder, signs_differ).astype(a.dtype)
    it.set(f["out"], mx.subtract(mx.divide(a, b), adjust))


@node("NoopNode")
def _noop(it: Interpreter, f: dict) -> None:
    pass


@node("AddmmNode")
def _addmm(it: Interpreter, f: dict) -> None:
    """mlx::addmm(bias, a, b, alpha, beta) with a bias; without one the runtime calls
    plain matmul, so alpha is not applied."""
    mat1, mat2, bias = it.t(f["mat1"]), it.t(f["mat2"]), it.t(f["bias"])
    if bias is None:
        it.set(f["out"], mx.matmul(mat1, mat2))
        return
    it.set(f["out"], mx.addmm(bias, mat1, mat2, alpha=f["alpha"], beta=f["beta"]))


@node("GeluNode")
def _gelu_node(it: Interpreter, f: dict) -> None:
    it.set(f["out"], _gelu(it.t(f["x"]), f["approximate"]))


@node("LayerNormNode")
def _layer_norm(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.fast.layer_norm(it.t(f["x"]), it.t(f["weight"]), it.t(f["bias"]), f["eps"]))


@node("RMSNormNode")
def _rms_norm(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.fast.rms_norm(it.t(f["x"]), it.t(f["weight"]), f["eps"]))


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
    """A -1 keeps the input's dimension, aligned from the right; on a new leading
    dimension it stays -1 and mlx refuses it, as on the device."""
    x = it.t(f["x"])
    shape = it.vs(f["shape"])
    offset = len(shape) - x.ndim
    shape = [x.shape[i - offset] if s == -1 and 0 <= i - offset < x.ndim else s for i, s in enumerate(shape)]
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


def _mlx_slice(start: int, stop: int, step: int, size: int) -> slice:
    """mlx::core::slice's bounds (normalize_slice) as a Python slice. Like numpy:
    negative bounds count from the end; with a negative step a stop of -1 after
    that means "through index 0", which a Python slice cannot say with -1."""
    start = start + size if start < 0 else start
    stop = stop + size if stop < 0 else stop
    if step > 0:
        start, stop = max(0, min(start, size)), max(0, min(stop, size))
        return slice(start, max(start, stop), step)
    first = min(start, size - 1)
    last = min(max(stop, -1), first)
    count = max(0, (first - last + (-step) - 1) // (-step))
    if count == 0:
        return slice(0, 0)
    end = first + step * count
    return slice(first, end if end >= 0 else None, step)


def _axis_index(x: mx.array, axis: int, bounds: slice) -> tuple:
    index = [slice(None)] * x.ndim
    index[axis] = bounds
    return tuple(index)


@node("SliceNode")
def _slice(it: Interpreter, f: dict) -> None:
    x = it.t(f["x"])
    if f["step"] == 0:
        raise MLXNodeFailure("Slice: step must not be 0")
    axis = it.v(f["axis"]) % x.ndim
    bounds = _mlx_slice(it.v(f["start"]), it.v(f["stop"]), f["step"], x.shape[axis])
    it.set(f["out"], x[_axis_index(x, axis, bounds)])


@node("SliceUpdateNode")
def _slice_update(it: Interpreter, f: dict) -> None:
    """The runtime clamps start and stop to the axis (no wrap past it) and wants step >= 1."""
    dst = it.t(f["dst"])
    axis = it.v(f["axis"]) % dst.ndim
    size = dst.shape[axis]
    start, stop = it.v(f["start"]), it.v(f["stop"])
    start = max(0, min(size, start + size if start < 0 else start))
    stop = max(0, min(size, stop + size if stop < 0 else stop))
    if f["step"] < 1:
        raise MLXNodeFailure(f"SliceUpdate: step must be >= 1, got {f['step']}")
    if start == stop:
        it.set(f["out"], dst)
        return
    out = mx.array(dst)
    out[_axis_index(dst, axis, slice(start, stop, f["step"]))] = it.t(f["update"])
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


def _filled(shape, value, dtype) -> mx.array:
    """mlx::full(shape, value, dtype) as the C++ runtime calls it: the value cast to dtype,
    then broadcast. (mlx's Python `mx.full(shape, 1.0, dtype=mx.bool_)` returns float32.)"""
    return mx.full(shape, mx.array(value, dtype=dtype))


@node("FullNode")
def _full(it: Interpreter, f: dict) -> None:
    it.set(f["out"], _filled(it.vs(f["shape"]), it.v(f["v"]), mx_dtype(f["scalar_type"])))


@node("FullLikeNode")
def _full_like(it: Interpreter, f: dict) -> None:
    x = it.t(f["x"])
    dtype = x.dtype if f["scalar_type"] is None else mx_dtype(f["scalar_type"])
    it.set(f["out"], _filled(x.shape, it.v(f["v"]), dtype))


@node("ARangeNode")
def _arange(it: Interpreter, f: dict) -> None:
    # No dtype: MLX infers it from the int bounds, which is int32 (not torch's int64).
    dtype = mx.int32 if f["scalar_type"] is None else mx_dtype(f["scalar_type"])
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


node("ArgmaxNode")(_arg(mx.argmax))
node("ArgminNode")(_arg(mx.argmin))


def _moment(function):
    def run(it: Interpreter, f: dict) -> None:
        x = it.t(f["x"])
        axes = list(f["axes"]) or list(range(x.ndim))
        it.set(f["out"], function(x, axis=axes, keepdims=bool(f["keepdims"]), ddof=int(f["ddof"])))

    return run


node("VarNode")(_moment(mx.var))
node("StdNode")(_moment(mx.std))


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


# --- sorting and selection ------------------------------------------------------------


@node("RoundNode")
def _round(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.round(it.t(f["x"]), f["decimals"]))


@node("SortNode")
def _sort(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.sort(it.t(f["x"]), axis=f["axis"]))


@node("ArgsortNode")
def _argsort(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.argsort(it.t(f["x"]), axis=f["axis"]))


@node("PartitionNode")
def _partition(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.partition(it.t(f["x"]), int(it.v(f["kth"])), axis=f["axis"]))


@node("ArgPartitionNode")
def _argpartition(it: Interpreter, f: dict) -> None:
    it.set(f["out"], mx.argpartition(it.t(f["x"]), int(it.v(f["kth"])), axis=f["axis"]))


@node("MedianNode")
def _median(it: Interpreter, f: dict) -> None:
    """mlx::median: the mean of the two middle values for an even count (torch takes the lower)."""
    x = it.t(f["x"])
    axes = list(f["axes"]) or None
    it.set(f["out"], mx.median(x, axis=axes, keepdims=bool(f["keepdims"])))


# --- making and viewing ---------------------------------------------------------------


@node("TriNode")
def _tri(it: Interpreter, f: dict) -> None:
    rows, cols = int(it.v(f["n"])), int(it.v(f["m"]))
    it.set(f["out"], mx.tri(rows, cols, f["k"], dtype=mx_dtype(f["scalar_type"])))


@node("AsStridedNode")
def _as_strided(it: Interpreter, f: dict) -> None:
    """mlx::as_strided reads the input in row-major order (it flattens it first),
    whatever layout the array had: strides are in elements of that order."""
    x = it.t(f["x"])
    it.set(f["out"], mx.as_strided(x, it.vs(f["shape"]), it.vs(f["strides"]), f["offset"]))


@node("IndexCopyNode")
def _index_copy(it: Interpreter, f: dict) -> None:
    """dst[..., indices[i], ...] = update[..., i, ...] along the axis, in index order
    (a repeated index keeps the last write), as the runtime's run-by-run slice updates do."""
    dst, update, indices = it.t(f["dst"]), it.t(f["update"]), it.t(f["indices"])
    if indices.ndim != 1:
        raise MLXNodeFailure("IndexCopyNode: indices must be 1D")
    if indices.dtype != mx.int64:
        raise MLXNodeFailure(f"IndexCopyNode: expected int64 indices, got {indices.dtype}")
    axis = f["axis"] % dst.ndim
    size = dst.shape[axis]
    positions = []
    for raw in np.array(indices).tolist():
        position = raw + size if raw < 0 else raw
        if not 0 <= position < size:
            raise MLXNodeFailure(f"IndexCopyNode: index {raw} out of range for axis {axis} with size {size}")
        positions.append(position)
    out = mx.array(dst)
    for i, position in enumerate(positions):
        out[_axis_index(out, axis, slice(position, position + 1))] = update[
            _axis_index(update, axis, slice(i, i + 1))
        ]
    it.set(f["out"], out)


# --- random bits ----------------------------------------------------------------------

_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_BITS_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _threefry2x32(key: tuple[int, int], first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Threefry-2x32 (20 rounds) hash of counter pairs under a key, which MLX's
    RandomBits primitive uses; vectorised over the counters."""
    ks = [np.uint32(key[0]), np.uint32(key[1]), np.uint32(key[0] ^ key[1] ^ 0x1BD11BDA)]
    x0 = first.astype(np.uint32) + ks[0]
    x1 = second.astype(np.uint32) + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = (x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r))
            x1 = x1 ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def random_bits(shape: list[int], width: int, key: tuple[int, int]) -> np.ndarray:
    """mlx::random::bits(shape, width, key) for one key: the output's bytes as 32-bit
    words, the first half from the hashes' first halves and the second half from
    their second halves, an odd middle word hashed on its own."""
    nbytes = math.prod(shape) * width
    words = (nbytes + 3) // 4
    half, odd = words // 2, words % 2
    out = np.zeros(max(words, 1), dtype=np.uint32)
    counters = np.arange(half, dtype=np.uint32)
    with np.errstate(over="ignore"):
        low, high = _threefry2x32(key, counters, counters + np.uint32(half + odd))
        out[:half] = low
        out[half + odd : 2 * half + odd] = high
        if odd:
            out[half] = _threefry2x32(key, np.array([half], np.uint32), np.array([0], np.uint32))[0][0]
    return out.view(np.uint8)[:nbytes].view(_BITS_DTYPES[width]).reshape(shape)


@node("RandomBitsNode")
def _random_bits(it: Interpreter, f: dict) -> None:
    """With a seed, mlx::random::key(seed) (the int32 seed widened to uint64 as the
    runtime does); without one, a key drawn from mlx's global key sequence."""
    width = f["width"]
    if width not in _BITS_DTYPES:
        raise MLXNodeFailure("random_bits: width must be 1, 2, or 4")
    if f["seed"] is not None:
        key = mx.random.key(int(it.v(f["seed"])) % 2**64)
    else:
        key = mx.random.randint(0, 2**31 - 1, [2]).astype(mx.uint32)
    k0, k1 = (int(v) for v in np.array(key).tolist())
    it.set(f["out"], mx.array(random_bits(list(it.vs(f["shape"])), width, (k0, k1))))


# --- control flow ---------------------------------------------------------------------


@node("ScanNode")
def _scan(it: Interpreter, f: dict) -> None:
    """The runtime's exec_scan: for each step t along scan_axis, write slice t of each
    original into its `sliced` slot, run the body chain (carry slots persist from
    step to step), collect each output; then stack the collected outputs on the axis."""
    axis = f["scan_axis"]
    originals = [it.t(ref) for ref in f["originals"]]
    collected: list[list[mx.array]] = [[] for _ in f["outputs"]]
    for t in range(originals[0].shape[axis]):
        for ref, original in zip(f["sliced"], originals):
            it.set(ref, mx.take(original, t, axis=axis))
        it.run_chain(f["body_chain_idx"])
        for steps, ref in zip(collected, f["outputs"]):
            steps.append(it.t(ref))
    for steps, ref in zip(collected, f["outputs"]):
        it.set(ref, mx.stack(steps, axis=axis))
