"""Node functions for the MLX payload's quantized and gathered matrix products.

The weights are in MLX's own quantized format (packed uint32 words, a scale
and, for mode "affine", a bias per `group_size` elements along the last axis),
which the handlers in ExecuTorch's `backends/mlx` convert TorchAO's weights to
when they lower; these nodes call `mlx.core`'s dequantize / quantized_matmul /
gather_mm / gather_qmm with the node's parameters, as the runtime does, and the
quantized products in the precision the runtime's Metal kernels keep.
"""

from __future__ import annotations

import mlx.core as mx

from compiler.backends.mlx.interpreter import Interpreter, mx_dtype, node


def _gathering(it: Interpreter, f: dict) -> dict:
    """Which matrices a gathered product takes, as mlx.core's keywords; a run-time sorted
    flag, when the payload has one, overrides the static bool."""
    lhs, rhs = it.t(f["lhs_indices"]), it.t(f["rhs_indices"])
    flag = f["sorted_indices_flag"]
    sorted_indices = int(it.v(flag)) != 0 if flag is not None else bool(f["sorted_indices"])
    return {"lhs_indices": lhs, "rhs_indices": rhs, "sorted_indices": sorted_indices}


def _packed_weight(it: Interpreter, f: dict) -> tuple[mx.array, mx.array, mx.array]:
    """The quantized weight's arrays, in the order mlx.core takes them: packed words, scales, biases."""
    return it.t(f["w"]), it.t(f["scales"]), it.t(f["biases"])


def _in_float32(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array | None):
    """The operands of a quantized product as the device computes with them. MLX's Metal kernels
    (qmv, qmm: `typedef float U`) dequantize each group and accumulate in float32 whatever the
    input's dtype, and round the result once; mlx's CPU kernel accumulates in the input's
    dtype, which on a bfloat16 Linear of 128 inputs is 7x eager's error (0.039 against 0.005)."""
    if x.dtype not in (mx.bfloat16, mx.float16):
        return x, w, scales, biases
    return x.astype(mx.float32), w, scales.astype(mx.float32), None if biases is None else biases.astype(mx.float32)


def _packing(f: dict) -> dict:
    """How the weight is packed, as mlx.core's keywords: elements per scale, bits per element, mode."""
    return {"group_size": f["group_size"], "bits": f["bits"], "mode": f["mode"]}


@node("DequantizeNode")
def _dequantize(it: Interpreter, f: dict) -> None:
    out = mx.dequantize(
        *_packed_weight(it, f),
        **_packing(f),
        global_scale=it.t(f["global_scale"]),
        dtype=None if f["dtype"] is None else mx_dtype(f["dtype"]),
    )
    it.set(f["out"], out)


@node("QuantizedMatmulNode")
def _quantized_matmul(it: Interpreter, f: dict) -> None:
    x = it.t(f["x"])
    operands = _in_float32(x, *_packed_weight(it, f))
    out = mx.quantized_matmul(*operands, transpose=bool(f["transpose"]), **_packing(f))
    it.set(f["out"], out.astype(x.dtype))


@node("GatherMmNode")
def _gather_mm(it: Interpreter, f: dict) -> None:
    out = mx.gather_mm(it.t(f["a"]), it.t(f["b"]), **_gathering(it, f))
    it.set(f["out"], out)


@node("GatherQmmNode")
def _gather_qmm(it: Interpreter, f: dict) -> None:
    x = it.t(f["x"])
    operands = _in_float32(x, *_packed_weight(it, f))
    out = mx.gather_qmm(*operands, transpose=bool(f["transpose"]), **_packing(f), **_gathering(it, f))
    it.set(f["out"], out.astype(x.dtype))
