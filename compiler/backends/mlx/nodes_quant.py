"""Node functions for the MLX payload's quantized and gathered matrix products.

The weights are in MLX's own quantized format (packed uint32 words, a scale
and, for mode "affine", a bias per `group_size` elements along the last axis),
which the handlers in ExecuTorch's `backends/mlx` convert TorchAO's weights to
when they lower; these nodes call `mlx.core`'s dequantize / quantized_matmul /
gather_mm / gather_qmm with the node's parameters, as the runtime does.
"""

from __future__ import annotations

import mlx.core as mx

from compiler.backends.mlx.interpreter import Interpreter, mx_dtype, node


def _sorted_indices(it: Interpreter, f: dict) -> bool:
    """A run-time flag, when the payload has one, overrides the static bool."""
    if f["sorted_indices_flag"] is not None:
        return int(it.v(f["sorted_indices_flag"])) != 0
    return bool(f["sorted_indices"])


@node("DequantizeNode")
def _dequantize(it: Interpreter, f: dict) -> None:
    out = mx.dequantize(
        it.t(f["w"]),
        it.t(f["scales"]),
        it.t(f["biases"]),
        group_size=f["group_size"],
        bits=f["bits"],
        mode=f["mode"],
        global_scale=it.t(f["global_scale"]),
        dtype=None if f["dtype"] is None else mx_dtype(f["dtype"]),
    )
    it.set(f["out"], out)


@node("QuantizedMatmulNode")
def _quantized_matmul(it: Interpreter, f: dict) -> None:
    out = mx.quantized_matmul(
        it.t(f["x"]),
        it.t(f["w"]),
        it.t(f["scales"]),
        it.t(f["biases"]),
        transpose=bool(f["transpose"]),
        group_size=f["group_size"],
        bits=f["bits"],
        mode=f["mode"],
    )
    it.set(f["out"], out)


@node("GatherMmNode")
def _gather_mm(it: Interpreter, f: dict) -> None:
    out = mx.gather_mm(
        it.t(f["a"]),
        it.t(f["b"]),
        it.t(f["lhs_indices"]),
        it.t(f["rhs_indices"]),
        sorted_indices=_sorted_indices(it, f),
    )
    it.set(f["out"], out)


@node("GatherQmmNode")
def _gather_qmm(it: Interpreter, f: dict) -> None:
    out = mx.gather_qmm(
        it.t(f["x"]),
        it.t(f["w"]),
        it.t(f["scales"]),
        it.t(f["biases"]),
        it.t(f["lhs_indices"]),
        it.t(f["rhs_indices"]),
        transpose=bool(f["transpose"]),
        group_size=f["group_size"],
        bits=f["bits"],
        mode=f["mode"],
        sorted_indices=_sorted_indices(it, f),
    )
    it.set(f["out"], out)
