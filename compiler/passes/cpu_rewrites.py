"""Rewrites of CPU calls the portable kernels refuse into calls they take, exactly.

Run by the partition stage after the backend's search, on untagged nodes only: a
delegate may take what the portable kernel refuses (Core ML converts a 3-D convolution
itself), and what a delegate gets is not changed. Each rewrite answers one limit of
`compiler.ir.kernel_limits`; a call over a limit with no rewrite here, or one its
rewrite cannot take (symbolic sizes), is left as it is and the `cpu_ops_have_kernels`
invariant refuses it by name.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

import torch

from compiler.ir.graph import DELEGATION_TAG
from compiler.ir.kernel_limits import KERNEL_LIMITS, kernel_limit
from compiler.ir.node_builder import Builder
from compiler.ir.private_api import edge_ops

logger = logging.getLogger(__name__)

edge = edge_ops().edge.aten


def _static_shape(value: Any) -> list[int] | None:
    shape = list(value.shape) if isinstance(value, torch.Tensor) else None
    return shape if shape is not None and all(isinstance(size, int) for size in shape) else None


class _ConvSizes(NamedTuple):
    """A 3-D convolution's sizes: input (n, c, depth, h, w), output channels and
    (out_depth, out_h, out_w), and the weight's depth taps."""

    n: int
    c: int
    depth: int
    h: int
    w: int
    out_channels: int
    out_depth: int
    out_h: int
    out_w: int
    taps: int


def _conv_sizes(node: torch.fx.Node) -> _ConvSizes | None:
    """The sizes of a 3-D convolution node, or None if any is symbolic (the rewrites'
    views need numbers)."""
    shapes = [_static_shape(n.meta.get("val")) for n in (node.args[0], node.args[1], node)]
    if None in shapes:
        return None
    (n, c, depth, h, w), weight, (_, out_channels, out_depth, out_h, out_w) = shapes
    return _ConvSizes(n, c, depth, h, w, out_channels, out_depth, out_h, out_w, weight[2])


def conv3d_as_conv2d(node: torch.fx.Node, build: Builder) -> torch.fx.Node | None:
    """A 3-D convolution as one 2-D convolution per depth tap, summed: the portable kernel
    takes 3-D and 4-D inputs only. Tap k reads the depth-padded input at depths
    d * stride + k * dilation for every output depth d (one strided slice, folded into the
    batch), with the weight's k-th depth slice; height and width keep their stride, padding
    and dilation, and groups hold per tap. The bias is added once, by the first tap."""
    x, weight, bias, stride, padding, dilation, _transposed, _output_padding, groups = node.args
    sizes = _conv_sizes(node)
    if sizes is None:
        return None
    n, c, depth, h, w, out_channels, out_depth, out_h, out_w, taps = sizes
    if padding[0]:
        x = build(edge.constant_pad_nd.default, x, [0, 0, 0, 0, padding[0], padding[0]], 0.0)
    depth_major = build(edge.permute_copy.default, x, [0, 2, 1, 3, 4])
    total = None
    for k in range(taps):
        start = k * dilation[0]
        end = start + (out_depth - 1) * stride[0] + 1
        picked = build(edge.slice_copy.Tensor, depth_major, 1, start, end, stride[0])
        batch = build(edge.view_copy.default, picked, [n * out_depth, c, h, w])
        tap_weight = build(edge.select_copy.int, weight, 2, k)
        conv = build(
            edge.convolution.default,
            batch, tap_weight, bias if k == 0 else None,
            list(stride[1:]), list(padding[1:]), list(dilation[1:]), False, [0, 0], groups,
        )
        total = conv if total is None else build(edge.add.Tensor, total, conv)
    folded = build(edge.view_copy.default, total, [n, out_depth, out_channels, out_h, out_w])
    return build(edge.permute_copy.default, folded, [0, 2, 1, 3, 4])


def conv_transpose3d_as_conv2d(node: torch.fx.Node, build: Builder) -> torch.fx.Node | None:
    """A transposed 3-D convolution as one transposed 2-D convolution per depth tap, each
    placed at its output depths and summed: the portable kernel takes 3-D and 4-D inputs
    only. Input depth i with tap k lands on output depth i * stride + k * dilation - padding:
    a tap's result (all input depths folded into the batch) gets stride - 1 zero depths after
    each depth and is shifted by k * dilation; the sum is cut to the output's depths, where
    the output padding shows as the zeros past the last tap. The bias is added once, at the end."""
    x, weight, bias, stride, padding, dilation, _transposed, output_padding, groups = node.args
    sizes = _conv_sizes(node)
    if sizes is None:
        return None
    n, c, depth, h, w, out_channels, out_depth, out_h, out_w, taps = sizes
    plane = out_channels * out_h * out_w
    spread = (depth - 1) * stride[0] + 1  # a tap's output depths, stride apart
    full = max(out_depth + padding[0], spread + (taps - 1) * dilation[0])
    batch = build(edge.view_copy.default, build(edge.permute_copy.default, x, [0, 2, 1, 3, 4]), [n * depth, c, h, w])
    total = None
    for k in range(taps):
        tap_weight = build(edge.select_copy.int, weight, 2, k)
        conv = build(
            edge.convolution.default,
            batch, tap_weight, None,
            list(stride[1:]), list(padding[1:]), list(dilation[1:]), True, list(output_padding[1:]), groups,
        )
        placed = build(edge.view_copy.default, conv, [n, depth, 1, plane])
        placed = build(edge.constant_pad_nd.default, placed, [0, 0, 0, stride[0] - 1], 0.0)
        placed = build(edge.view_copy.default, placed, [n, depth * stride[0], plane])
        placed = build(edge.slice_copy.Tensor, placed, 1, 0, spread, 1)
        shift = k * dilation[0]
        placed = build(edge.constant_pad_nd.default, placed, [0, 0, shift, full - shift - spread], 0.0)
        total = placed if total is None else build(edge.add.Tensor, total, placed)
    cut = build(edge.slice_copy.Tensor, total, 1, padding[0], padding[0] + out_depth, 1)
    folded = build(edge.view_copy.default, cut, [n, out_depth, out_channels, out_h, out_w])
    result = build(edge.permute_copy.default, folded, [0, 2, 1, 3, 4])
    if bias is None:
        return result
    return build(edge.add.Tensor, result, build(edge.view_copy.default, bias, [1, out_channels, 1, 1, 1]))


def zero_dim_as_one_element(node: torch.fx.Node, build: Builder) -> torch.fx.Node | None:
    """The op on a 0-d input as the same op on that value viewed as one element, the
    result viewed back to the node's shape: the kernel refuses a dim argument on a 0-d
    input, where torch takes dim 0 or -1 as the tensor itself."""
    out_shape = _static_shape(node.meta.get("val"))
    if out_shape is None:
        return None
    flat = build(edge.view_copy.default, node.args[0], [1])
    called = build(node.target, flat, *node.args[1:], **node.kwargs)
    return build(edge.view_copy.default, called, out_shape)


def negative_pad_as_slice(node: torch.fx.Node, build: Builder) -> torch.fx.Node | None:
    """A negative padding as a slice that crops there, then the non-negative padding: the
    kernel takes non-negative padding only. torch crops the input the same way before it
    pads, so the values and the fill are the same."""
    x, pad = node.args[0], node.args[1]
    shape = _static_shape(x.meta.get("val"))
    if shape is None:
        return None
    for i in range(len(pad) // 2):
        dim, before, after = len(shape) - 1 - i, pad[2 * i], pad[2 * i + 1]
        if before < 0 or after < 0:
            x = build(edge.slice_copy.Tensor, x, dim, max(-before, 0), shape[dim] - max(-after, 0), 1)
    kept = [max(p, 0) for p in pad]
    return build(edge.constant_pad_nd.default, x, kept, *node.args[2:], **node.kwargs) if any(kept) else x


def fft_over_last_dims(node: torch.fx.Node, build: Builder) -> torch.fx.Node | None:
    """The transform over its dims moved last, permuted back after: the kernel takes a result
    laid out in its input's dim order only, which torch gives a transform over the last dims.
    Over symbolic sizes it declines: tracing `permute_copy` fixes them."""
    x, dims = node.args[0], node.args[1]
    if _static_shape(x.meta["val"]) is None:
        return None
    rank = x.meta["val"].dim()
    dims = [d % rank for d in dims]
    order = [d for d in range(rank) if d not in dims] + dims
    moved = build(edge.permute_copy.default, x, order)
    called = build(node.target, moved, list(range(rank - len(dims), rank)), *node.args[2:], **node.kwargs)
    return build(edge.permute_copy.default, called, [order.index(d) for d in range(rank)])


def index_as_int64(node: torch.fx.Node, build: Builder) -> torch.fx.Node | None:
    """The index cast to int64 first: the kernel reads int64 indices only, and every int32
    index holds as int64."""
    index = node.args[2]
    rank = index.meta["val"].dim()
    wide = build(edge_ops().edge.dim_order_ops._to_dim_order_copy.default, index, dtype=torch.int64,
                 dim_order=list(range(rank)))
    return build(node.target, *node.args[:2], wide, *node.args[3:], **node.kwargs)


# Limit name -> its rewrite: (node, builder) -> the node standing for the result, or None
# when it cannot rewrite this call.
REWRITES: dict[str, Callable[[torch.fx.Node, Builder], torch.fx.Node | None]] = {
    "conv3d": conv3d_as_conv2d,
    "conv_transpose3d": conv_transpose3d_as_conv2d,
    "cumsum_0d": zero_dim_as_one_element,
    "sum_0d": zero_dim_as_one_element,
    "pad_negative": negative_pad_as_slice,
    "fft_c2r_inner_dim": fft_over_last_dims,
    "fft_r2c_inner_dim": fft_over_last_dims,
    **dict.fromkeys(("gather_int32_index", "scatter_src_int32_index", "scatter_value_int32_index"), index_as_int64),
}


def rewrite_for_cpu_kernels(
    program: torch.export.ExportedProgram, cpu_reason: Callable[[torch.fx.Node], str]
) -> dict[str, str]:
    """Rewrite, in place, the CPU calls of `program` over a kernel limit that have a rewrite;
    returns new node name -> its placement reason: why the call is on the CPU
    (`cpu_reason`, the backend's) and why it was rewritten."""
    reasons = {}
    graph = program.graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.meta.get(DELEGATION_TAG):
            continue
        limit = kernel_limit(node)
        rewrite = REWRITES.get(limit.name) if limit else None
        if rewrite is None:
            continue
        build = Builder(node)
        result = rewrite(node, build)
        if result is None:
            for new in reversed(build.made):
                graph.erase_node(new)
            continue
        logger.debug("%s: %s rewritten into %d nodes", node.name, limit.name, len(build.made))
        node.replace_all_uses_with(result)
        for spec in program.graph_signature.output_specs:  # outputs are named by node
            if getattr(spec.arg, "name", None) == node.name:
                spec.arg.name = result.name
        graph.erase_node(node)
        reason = (
            f"{cpu_reason(node)}; there {node.name} was rewritten, since the portable kernel refuses "
            f"{limit.limit} ({limit.source})"
        )
        reasons |= dict.fromkeys((new.name for new in build.made), reason)
    if reasons:
        program.graph_module.recompile()
    return reasons


def limits_table() -> str:
    """The table (docs/stages.md) of the portable kernels' limits and what the compiler does about each."""
    rows = ["| op | the kernel refuses | its check | what the compiler does |", "|---|---|---|---|"]
    for limit in KERNEL_LIMITS:
        rewrite = REWRITES.get(limit.name)
        summary = " ".join(rewrite.__doc__.split(":")[0].split()) if rewrite else ""
        action = f"rewrites it: {summary[0].lower()}{summary[1:]}" if rewrite else "refuses it at compile time"
        check = f"`{limit.source}`: {limit.reason}".replace("|", "\\|")
        rows.append(f"| `{limit.op}` | {limit.limit} | {check} | {action} |")
    return "\n".join(rows)
