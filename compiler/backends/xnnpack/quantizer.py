"""XNNPACK's PT2E quantizer, with its scalar operands kept where they are integers and no
annotation on a value that is not floating point (`compiler.backends.pt2e`).

ExecuTorch 1.5.1's `XNNPACKQuantizer.transform_for_annotation` turns every scalar operand of an
`add` or `mul` into a float32 tensor constant, so the op can carry a quantization annotation. On
an integer op this changes what it computes: GPT-2's positions, `arange(n) + past_length`, turn
float, and its position embedding fails ("Expected tensor for argument #1 'indices' to have one
of the following scalar types: Long, Int; but got torch.FloatTensor"), on `int8_dynamic` and
`int8_static` alike. Integer ops are never quantized, so their scalars are put back.
"""

from __future__ import annotations

import torch
from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
    XNNPACKQuantizer,
    get_symmetric_quantization_config,
)

from compiler.backends.pt2e import drop_unquantizable_annotations

_SCALAR_OPERAND_OPS = (torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor)


def _computes_floating(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_floating_point()


class IntegerSafeXnnpackQuantizer(XNNPACKQuantizer):
    """XNNPACK's quantizer, quantizing floating-point values only and leaving integer ops as they compute."""

    def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        model = super().annotate(model)
        drop_unquantizable_annotations(model)
        return model

    def transform_for_annotation(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        integer_ops = {
            node: node.args for node in model.graph.nodes
            if node.op == "call_function" and node.target in _SCALAR_OPERAND_OPS and not _computes_floating(node)
        }
        model = super().transform_for_annotation(model)
        for node, args in integer_ops.items():
            made = [a for a in node.args if isinstance(a, torch.fx.Node) and a not in args]
            node.args = args
            for constant in made:
                if not constant.users:
                    model.graph.erase_node(constant)
                    delattr(model, constant.target)
        model.recompile()
        return model


def pt2e_quantizer(per_channel: bool, dynamic: bool) -> XNNPACKQuantizer:
    """The symmetric int8 quantizer of ExecuTorch's XNNPACK recipes (per channel or per tensor
    weights, activations static or dynamic)."""
    return IntegerSafeXnnpackQuantizer().set_global(
        get_symmetric_quantization_config(is_per_channel=per_channel, is_dynamic=dynamic)
    )
