"""Node functions for the MLX payload's convolutions.

MLX convolutions are channels-last: the input is (N, *spatial, C_in) and the
weight (C_out, *kernel, C_in / groups), also for the transposed ones. The
handlers in ExecuTorch's `backends/mlx/ops.py` transpose the activation around
each node and store the weight in that layout; a node only calls `mlx.core`'s
convolution with its fields, as the runtime (`exec_conv*`) does. The bias is
a separate AddNode.
"""

from __future__ import annotations

import mlx.core as mx

from compiler.backends.mlx.interpreter import Interpreter, node


def _per_axis(f: dict, name: str, axes: str) -> tuple[int, ...]:
    return tuple(f[f"{name}_{a}"] for a in axes)


@node("Conv1DNode")
def _conv1d(it: Interpreter, f: dict) -> None:
    out = mx.conv1d(it.t(f["x"]), it.t(f["w"]), f["stride"], f["padding"], f["dilation"], f["groups"])
    it.set(f["out"], out)


@node("Conv2DNode", "Conv3DNode")
def _conv_nd(it: Interpreter, f: dict) -> None:
    axes = "hw" if "stride_d" not in f else "dhw"
    conv = mx.conv2d if len(axes) == 2 else mx.conv3d
    out = conv(
        it.t(f["x"]),
        it.t(f["w"]),
        _per_axis(f, "stride", axes),
        _per_axis(f, "padding", axes),
        _per_axis(f, "dilation", axes),
        f["groups"],
    )
    it.set(f["out"], out)


@node("ConvTranspose1DNode")
def _conv_transpose1d(it: Interpreter, f: dict) -> None:
    out = mx.conv_transpose1d(
        it.t(f["x"]), it.t(f["w"]), f["stride"], f["padding"], f["dilation"], f["output_padding"], f["groups"]
    )
    it.set(f["out"], out)


@node("ConvTranspose2DNode", "ConvTranspose3DNode")
def _conv_transpose_nd(it: Interpreter, f: dict) -> None:
    axes = "hw" if "stride_d" not in f else "dhw"
    conv = mx.conv_transpose2d if len(axes) == 2 else mx.conv_transpose3d
    out = conv(
        it.t(f["x"]),
        it.t(f["w"]),
        _per_axis(f, "stride", axes),
        _per_axis(f, "padding", axes),
        _per_axis(f, "dilation", axes),
        _per_axis(f, "output_padding", axes),
        f["groups"],
    )
    it.set(f["out"], out)
