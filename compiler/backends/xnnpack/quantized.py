"""What XNNPACK makes of a quantized program's nodes, in words for the placement report.

A delegated node's reason is otherwise only that the partitioner took it. In a quantized
program that hides what runs: XNNPACK folds the quantize, dequantize and choose_qparams
nodes into the op that reads them, computes a GEMM whose input and weight are quantized
with its integer kernels (dynamic int8 activations: a scale per row, chosen at run time,
where PT2E's eager reference takes one per tensor), and computes a GEMM nothing quantizes
(an op no quantizer annotates, as the batched matmuls of attention; a layer a TorchAO
filter skipped, as a convolution under 8da4w) in float32. Each such node says which.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from executorch.backends.xnnpack.utils.quant_utils import (
    extract_qdq_affine_op_args_for_decomposed_ops,
    is_affine_qdq,
    is_dequant,
    is_dynamic_qdq,
    is_per_channel,
    is_qparam,
    is_quant,
)

from compiler.backends.xnnpack.rules import GEMM_ARGUMENTS
from compiler.ir.dialect import op_name
from compiler.ir.graph import op_nodes

# GEMM op -> (activation argument, weight argument): those whose weight stock's GEMM configs
# read (`rules.GEMM_ARGUMENTS`), and a batched matmul, which reads two activations.
_GEMMS = {
    **{op: (activation, weight) for op, (weight, activation) in GEMM_ARGUMENTS.items()},
    "aten.bmm.default": (0, 1),
}

FLOAT_GEMM_REASON = (
    "a float32 GEMM in a quantized program: nothing quantizes its inputs (the scheme's quantizer annotates "
    "no such op, or its filter skipped the layer)"
)
_DYNAMIC = "int8 activations quantized per row at run time"


def _quantizing(node: torch.fx.Node) -> bool:
    return is_quant(node) or is_dequant(node) or is_qparam(node)


def _qdq_arguments(node: torch.fx.Node) -> list:
    """A quantize or dequantize node's arguments in quantized_decomposed's order: input, scale(s),
    zero point(s), [axis,] quant_min, quant_max, dtype."""
    return extract_qdq_affine_op_args_for_decomposed_ops(node) if is_affine_qdq(node) else list(node.args)


def _constant(node: torch.fx.Node, program: ExportedProgram) -> bool:
    signature = program.graph_signature
    constants = {**signature.inputs_to_parameters, **signature.inputs_to_buffers,
                 **signature.inputs_to_lifted_tensor_constants}
    return node.op == "placeholder" and node.name in constants


def _weight(dequantize: torch.fx.Node) -> str:
    """A weight's dequantize in words: its bits and how its scales are shared."""
    arguments = _qdq_arguments(dequantize)
    offset = 1 if is_per_channel(dequantize) and not is_affine_qdq(dequantize) else 0  # the axis
    quant_max = arguments[4 + offset]
    bits = "int4" if quant_max <= 7 else "int8"
    if is_affine_qdq(dequantize):
        group, columns = dequantize.args[1][-1], dequantize.args[0].meta["val"].shape[-1]
        shared = "a scale per output channel" if group == columns else f"a scale per group of {group}"
    else:
        shared = "a scale per output channel" if is_per_channel(dequantize) else "one scale"
    return f"{bits} weights, {shared}"


def _activation(dequantize: torch.fx.Node) -> str:
    return _DYNAMIC if is_dynamic_qdq(dequantize) else "int8 activations with a calibrated scale"


def _gemm_reason(gemm: torch.fx.Node, program: ExportedProgram) -> str | None:
    activation_at, weight_at = _GEMMS[op_name(gemm.target)]
    if len(gemm.args) <= weight_at:
        return None
    activation, weight = gemm.args[activation_at], gemm.args[weight_at]
    quantized = [a for a in (activation, weight) if isinstance(a, torch.fx.Node) and is_dequant(a)]
    if not quantized:
        return FLOAT_GEMM_REASON
    if not (activation in quantized and weight in quantized and _constant(weight.args[0], program)):
        return None  # a weight-only or unusual pattern: XNNPACK's own reason stands
    return f"XNNPACK computes it as a quantized GEMM: {_activation(activation)} x {_weight(weight)}"


def _quantizing_reason(node: torch.fx.Node, program: ExportedProgram) -> str:
    if is_qparam(node):
        return ("chooses the int8 scale of a GEMM's input at run time: XNNPACK's quantized GEMM chooses "
                "it itself, per row")
    static = not is_dynamic_qdq(node)
    if is_dequant(node) and _constant(node.args[0], program):
        return f"the quantized weight of a GEMM: {_weight(node)}, which XNNPACK stores so (nothing dequantizes it)"
    scale = " with its calibrated scale" if static else ""
    if is_quant(node):
        kept = "XNNPACK keeps the value in int8 for the ops that read it" if static else (
            "part of XNNPACK's quantized GEMM, which quantizes each row itself")
        return f"quantizes an activation to int8{scale}: {kept}"
    return f"dequantizes an int8 activation{scale}: the XNNPACK op that reads it takes the int8 values"


def delegated_reasons(program: ExportedProgram) -> dict[str, str]:
    """Node name -> what XNNPACK makes of it, for the quantize-family nodes and GEMMs of a quantized
    program (none for a float program)."""
    nodes = list(op_nodes(program))
    if not any(_quantizing(node) for node in nodes):
        return {}
    reasons = {}
    for node in nodes:
        if _quantizing(node):
            reasons[node.name] = _quantizing_reason(node, program)
        elif op_name(node.target) in _GEMMS and (reason := _gemm_reason(node, program)):
            reasons[node.name] = reason
    return reasons
