"""Exact rewrites that move CPU ops into XNNPACK: ops its partitioner refuses, spelled in ops it takes.

ExecuTorch 1.5.1's XNNPACK configs (backends/xnnpack/partition/config) have no expand, split,
squeeze, select, alias, copy or slice_scatter; they take `mean.dim` only over the last two dims
of a 4-D tensor (its global average pooling), `pow` only with the int exponent 2, `mul` only
with a tensor operand, and `cat` of two or more distinct tensors. Each such node between two
delegated ops ran on the CPU and cut the delegate in two (a transformer's attention scale and
no-op expands, GPT-2's `x ** 3`, Qwen3's RMSNorm mean and grouped-query `repeat_kv`, SmolVLM's
rotary embedding written in halves).

Each move below rewrites one node into ops XNNPACK takes, before the partition search, only
where every tensor it reads and makes is float32 with static sizes (what those ops take): a
move computes what eager computes, in the same order where torch has one (x * x * x for
`x ** 3`, as torch's pow kernel does), and within float32 rounding where it reduces (a mean is
a matrix product with a constant column of 1/n, summed in the GEMM's order, not torch's).
A move decides whether it applies before it inserts anything.

Not moved: layer norm. Written in XNNPACK's ops (two means, sub, square, rsqrt, scale, shift:
seven passes over the tensor where the CPU kernel makes two) it ran 1.01-1.2x slower than on
the CPU with the delegate cut around it (transformer stack, GPT-2, SigLIP), with the mean as a
GEMM or as XNNPACK's global average pooling alike.
"""

from __future__ import annotations

import logging
import math
import operator
from typing import Callable, Optional, Union

import torch
from torch.export import ExportedProgram

from compiler.backends.xnnpack.rules import Constants, replace_uses
from compiler.ir.dialect import op_name
from compiler.ir.node_builder import Builder
from compiler.ir.private_api import edge_ops

logger = logging.getLogger(__name__)

edge = edge_ops().edge.aten

Moved = Union[torch.fx.Node, list, None]  # the node standing for the result, one per item of a tuple result, or None
MOST_DIMS = 6  # XNNPACK's tensors (XNN_MAX_TENSOR_DIMS)
# Binary ops XNNPACK takes that broadcast their operands (numpy rules), as torch's do.
_BROADCASTING = {"aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor",
                 "aten.maximum.default", "aten.minimum.default"}


def _shape(node) -> Optional[list[int]]:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        return None
    shape = list(value.shape)
    return shape if all(isinstance(size, int) and size > 0 for size in shape) else None


def _float32_static(node: torch.fx.Node) -> bool:
    """Every tensor the node reads and makes is float32 with static, non-zero sizes."""
    value = node.meta.get("val")
    made = list(value) if isinstance(value, (list, tuple)) else [value]
    return all(
        isinstance(v, torch.Tensor) and v.dtype == torch.float32 and all(isinstance(s, int) and s > 0 for s in v.shape)
        for v in made + [n.meta.get("val") for n in node.all_input_nodes]
    )


def _returned(node: torch.fx.Node) -> bool:
    return any(user.op == "output" for user in node.users)


def scalar_operand_as_tensor(node: torch.fx.Node, build: Builder, constants: Constants) -> Moved:
    """`mul.Scalar(x, s)` as `mul.Tensor(x, s)` with `s` a 0-d float32 constant: torch multiplies
    a float32 tensor by a Python number cast to float32 too."""
    return build(edge.mul.Tensor, node.args[0], constants(float(node.args[1]), torch.float32))


def power_as_products(node: torch.fx.Node, build: Builder, constants: Constants) -> Moved:
    """`x ** 2.0` as x * x and `x ** 3` as (x * x) * x, the products torch's pow kernel
    computes for these exponents (XNNPACK takes only the int exponent 2)."""
    x, exponent = node.args[0], node.args[1]
    if exponent not in (2, 3) or exponent == 2 and isinstance(exponent, int):
        return None
    square = build(edge.mul.Tensor, x, x)
    return square if exponent == 2 else build(edge.mul.Tensor, square, x)


def _broadcast_anyway(node: torch.fx.Node, source_shape: list[int]) -> bool:
    """Every user is a broadcasting binary op whose result keeps its size when it reads the
    expand's input instead."""
    for user in node.users:
        if user.op != "call_function" or op_name(user.target) not in _BROADCASTING:
            return False
        shapes = [source_shape if arg is node else _shape(arg) for arg in user.args[:2]]
        if None in shapes or torch.broadcast_shapes(*shapes) != user.meta["val"].shape:
            return False
    return True


def expand_as_copies(node: torch.fx.Node, build: Builder, constants: Constants) -> Moved:
    """An expand as its input where it changes nothing or only feeds ops that broadcast the
    same way; else as its input times a constant of ones over the expanded dims, which XNNPACK's
    mul broadcasts: x * 1.0 is x exactly (-0.0, infinities and NaN too), in every copy."""
    x = node.args[0]
    source, target = _shape(x), _shape(node)
    if source == target or _broadcast_anyway(node, source):
        return None if _returned(node) else x
    if len(target) > MOST_DIMS:
        return None
    ones = [1] * (len(target) - len(source)) + source
    ones = torch.ones([wanted if size != wanted else 1 for size, wanted in zip(ones, target)])
    return build(edge.mul.Tensor, x, constants.tensor(ones))


def split_as_slices(node: torch.fx.Node, build: Builder, constants: Constants) -> Moved:
    """A split as one slice per part (XNNPACK takes slice_copy with step 1): the same values."""
    x, sizes = node.args[0], node.args[1]
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(_shape(x))
    if any(user.target is not operator.getitem for user in node.users):
        return None
    length = _shape(x)[dim]
    if isinstance(sizes, int):
        sizes = [min(sizes, length - start) for start in range(0, length, sizes)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [build(edge.slice_copy.Tensor, x, dim, start, start + size, 1) for start, size in zip(starts, sizes)]


def _passed_on(node: torch.fx.Node):
    """What `node` passes on unchanged, if it does: alias_copy's input, a one-tensor cat's tensor,
    copy's source."""
    name = op_name(node.target)
    if name == "aten.cat.default":
        return node.args[0][0] if len(node.args[0]) == 1 else None
    return node.args[1] if name == "aten.copy.default" else node.args[0]


def same_values(node: torch.fx.Node, build: Builder, constants: Constants) -> Moved:
    """`alias_copy`, a `cat` of one tensor and `copy(dst, src)` of src's own size as the tensor
    whose values they pass on (Edge ops make new tensors: nothing shares storage); one the
    program returns stays (an output may not be another value passed on)."""
    source = _passed_on(node)
    if not isinstance(source, torch.fx.Node) or _shape(source) != _shape(node) or _returned(node):
        return None
    return source


def slice_scatter_as_cat(node: torch.fx.Node, build: Builder, constants: Constants) -> Moved:
    """A slice_scatter with step 1 as the base's slices before and after the written range
    concatenated with what is written there: the same values (the rotary embedding's halves)."""
    base, written = node.args[0], node.args[1]
    shape = _shape(base)
    dim = (node.args[2] if len(node.args) > 2 else 0) % len(shape)
    start, end, step = (node.args[i] if len(node.args) > i else default for i, default in ((3, None), (4, None), (5, 1)))
    if step != 1 or not all(isinstance(v, (int, type(None))) for v in (start, end)):
        return None
    start, end, _ = slice(start, end).indices(shape[dim])
    if end - start != _shape(written)[dim]:
        return None
    if start == 0 and end == shape[dim]:
        return None if _returned(node) else written
    parts = [build(edge.slice_copy.Tensor, base, dim, 0, start, 1)] if start > 0 else []
    parts.append(written)
    if end < shape[dim]:
        parts.append(build(edge.slice_copy.Tensor, base, dim, end, shape[dim], 1))
    return build(edge.cat.default, parts, dim)


def _trailing_mean(build: Builder, constants: Constants, x: torch.fx.Node, rows: int, n: int) -> torch.fx.Node:
    """The mean of each of `rows` rows of `n` values of `x` (rows, 1): `x` (rows, n) times a
    constant column of 1/n, a GEMM XNNPACK runs (its mean takes a 4-D tensor's last two dims only)."""
    flat = build(edge.view_copy.default, x, [rows, n])
    return build(edge.mm.default, flat, constants.tensor(torch.full((n, 1), 1.0 / n)))


def _trailing(dims, rank: int) -> Optional[int]:
    """How many trailing dims `dims` names, or None if they are not the last few."""
    named = sorted(d % rank for d in (dims if dims else range(rank)))
    return len(named) if named == list(range(rank - len(named), rank)) else None


def mean_as_matmul(node: torch.fx.Node, build: Builder, constants: Constants) -> Moved:
    """A mean over trailing dims (RMSNorm's) as a GEMM with a constant column of 1/n, viewed
    back; the form XNNPACK takes already (4-D, dims 2 and 3, keepdim) is left to it."""
    x = node.args[0]
    shape = _shape(x)
    dims = node.args[1] if len(node.args) > 1 else None
    count = _trailing(dims, len(shape)) if shape else None
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if count is None or node.kwargs.get("dtype") is not None or (len(shape) == 4 and count == 2 and keepdim):
        return None
    if not _shape(node):
        return None  # a 0-d mean: XNNPACK takes no 0-d tensor
    n = math.prod(shape[len(shape) - count:])
    mean = _trailing_mean(build, constants, x, math.prod(shape) // n, n)
    return build(edge.view_copy.default, mean, _shape(node))


def view_of_same_values(node: torch.fx.Node, build: Builder, constants: Constants) -> Moved:
    """squeeze, unsqueeze (XNNPACK takes the trailing one only) and select as a view of the same
    values, a select after slicing out its index: Edge tensors are contiguous, so the values keep
    their order."""
    x = node.args[0]
    if not _shape(node):
        return None  # a 0-d result: XNNPACK takes no 0-d tensor
    if op_name(node.target) == "aten.unsqueeze_copy.default" and node.args[1] in (-1, len(_shape(x))):
        return None  # the trailing unsqueeze XNNPACK takes
    if "select_copy" in op_name(node.target):
        dim = node.args[1] % len(_shape(x))
        index = node.args[2] % _shape(x)[dim]
        x = build(edge.slice_copy.Tensor, x, dim, index, index + 1, 1)
    return build(edge.view_copy.default, x, _shape(node))


# Op -> its move: (node, builder, constants) -> what stands for its result, or None to leave it.
MOVES: dict[str, Callable[[torch.fx.Node, Builder, Constants], Moved]] = {
    "aten.mul.Scalar": scalar_operand_as_tensor,
    "aten.pow.Tensor_Scalar": power_as_products,
    "aten.expand_copy.default": expand_as_copies,
    "aten.split_with_sizes_copy.default": split_as_slices,
    "aten.split_copy.Tensor": split_as_slices,
    "aten.mean.dim": mean_as_matmul,
    "aten.squeeze_copy.dims": view_of_same_values,
    "aten.squeeze_copy.dim": view_of_same_values,
    "aten.squeeze_copy.default": view_of_same_values,
    "aten.unsqueeze_copy.default": view_of_same_values,
    "aten.select_copy.int": view_of_same_values,
    "aten.alias_copy.default": same_values,
    "aten.cat.default": same_values,
    "aten.copy.default": same_values,
    "aten.slice_scatter.default": slice_scatter_as_cat,
}


def move_into_xnnpack(program: ExportedProgram) -> int:
    """Rewrites, in place, every float32 node of static sizes a move takes; returns how many."""
    graph = program.graph_module.graph
    constants = Constants(program, "_xnnpack_constant")
    moved = 0
    for node in list(graph.nodes):
        move = MOVES.get(op_name(node.target)) if node.op == "call_function" else None
        if move is None or not _float32_static(node):
            continue
        result = move(node, Builder(node), constants)
        if result is None:
            continue
        if isinstance(result, list):  # a tuple's items, read through getitem
            for user in list(node.users):
                replace_uses(program, user, result[user.args[1]])
                graph.erase_node(user)
        else:
            replace_uses(program, node, result)
        graph.erase_node(node)
        moved += 1
    if moved:
        graph.lint()
        program.graph_module.recompile()
        logger.info("XNNPACK: %d CPU ops rewritten into ops it takes", moved)
    return moved
