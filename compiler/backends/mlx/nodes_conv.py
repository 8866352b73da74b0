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


def _geometry(f: dict, name: str):
    """A node's stride/padding/... : one int on 1-D nodes, else one per axis (`stride_h`, ...)."""
    if name in f:
        return f[name]
    axes = "dhw" if f"{name}_d" in f else "hw"
    return tuple(f[f"{name}_{a}"] for a in axes)


def _convolution(function, transposed: bool):
    names = ("stride", "padding", "dilation") + (("output_padding",) if transposed else ())

    def run(it: Interpreter, f: dict) -> None:
        geometry = [_geometry(f, name) for name in names]
        it.set(f["out"], function(it.t(f["x"]), it.t(f["w"]), *geometry, f["groups"]))

    return run


for _kind, _function in {
    "Conv1DNode": mx.conv1d,
    "Conv2DNode": mx.conv2d,
    "Conv3DNode": mx.conv3d,
    "ConvTranspose1DNode": mx.conv_transpose1d,
    "ConvTranspose2DNode": mx.conv_transpose2d,
    "ConvTranspose3DNode": mx.conv_transpose3d,
}.items():
    node(_kind)(_convolution(_function, transposed=_kind.startswith("ConvTranspose")))
