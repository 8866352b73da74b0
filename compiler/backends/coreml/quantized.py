"""The deployment target a program's quantized ops need of Core ML.

coremltools makes MIL ops of them that exist only from some opset on, and fails (or, below
iOS 18, refuses blockwise scales and tables) when the target is lower:

- PT2E's quantize/dequantize (`quantized_decomposed`) become MIL's quantize and dequantize,
  iOS 17 (weights: constexpr_affine_dequantize, iOS 16);
- TorchAO's `dequantize_affine` becomes constexpr_blockwise_shift_scale, iOS 18, except
  int8 with one scale per output channel: constexpr_affine_dequantize, iOS 16;
- the codebook's `dequantize_codebook` becomes constexpr_lut_to_dense with a table per
  block, iOS 18.

These are the targets ExecuTorch's Core ML recipes set for the same schemes
(`coreml_recipe_provider.py`).
"""

from __future__ import annotations

from typing import Optional

import attrs
import coremltools as ct
import torch
from torch.export import ExportedProgram

from compiler.ir.dialect import op_name


@attrs.frozen
class Need:
    target: ct.target
    node: str
    op: str
    why: str


def _int8_per_channel(node: torch.fx.Node) -> bool:
    data, block_size, *_ = node.args
    quant_min, quant_max = node.args[5:7]
    shape = data.meta["val"].shape if isinstance(data, torch.fx.Node) and "val" in data.meta else None
    return (quant_min, quant_max) == (-128, 127) and shape is not None and list(block_size) == [1, shape[-1]]


def node_need(node: torch.fx.Node) -> Optional[Need]:
    """The target `node` needs, if it is a quantized op."""
    if node.op != "call_function":
        return None
    op = op_name(node.target)
    if op.startswith("quantized_decomposed."):
        return Need(ct.target.iOS17, node.name, op, "Core ML's quantize and dequantize ops start at iOS17")
    if op.startswith("torchao.dequantize_affine."):
        if _int8_per_channel(node):
            why = "int8 weights per channel become constexpr_affine_dequantize (iOS16)"
            return Need(ct.target.iOS16, node.name, op, why)
        why = "int4 or blockwise weights become constexpr_blockwise_shift_scale (iOS18)"
        return Need(ct.target.iOS18, node.name, op, why)
    if op.startswith("quant.dequantize_codebook."):
        return Need(ct.target.iOS18, node.name, op, "a table per block becomes constexpr_lut_to_dense (iOS18)")
    return None


def program_need(program: ExportedProgram) -> Optional[Need]:
    """The highest target the quantized ops of `program` need (None: it has none)."""
    needs = [need for node in program.graph.nodes if (need := node_need(node))]
    return max(needs, key=lambda need: need.target.value, default=None)
