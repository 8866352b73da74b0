"""What every PT2E quantizer the backends use gets wrong the same way, put right once.

XNNPACK's and Core ML's quantizers annotate ops by kind: a `cat`, a `view` after an annotated
op, an `add` or `mul` shares its inputs' quantization whatever their dtype. pi0 concatenates its
bool padding masks with `torch.cat`, so an observer lands on a bool tensor, and calibration or
convert fails: `"linspace_cpu" not implemented for 'Bool'`, `fake_quantize ... not implemented
for 'Bool'`. Only float32 and half-precision values are quantized: annotations on the others
(bool, integer, float64) are dropped.
"""

from __future__ import annotations

import torch


# What int8 quantization stands for: float64 values (pi0's sinusoidal timestep embedding) are
# computed in float64 on purpose; a quantize-dequantize pair there returns float32.
QUANTIZABLE = (torch.float32, torch.float16, torch.bfloat16)


def _quantizable_or_unknown(node: object) -> bool:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return not isinstance(value, torch.Tensor) or value.dtype in QUANTIZABLE


def drop_unquantizable_annotations(model: torch.fx.GraphModule) -> int:
    """Each PT2E annotation of a value not of a `QUANTIZABLE` dtype (an input edge or an output)
    removed; returns how many."""
    dropped = 0
    for node in model.graph.nodes:
        annotation = node.meta.get("quantization_annotation")
        if annotation is None:
            continue
        if annotation.output_qspec is not None and not _quantizable_or_unknown(node):
            annotation.output_qspec = None
            dropped += 1
        kept = {arg: spec for arg, spec in annotation.input_qspec_map.items() if _quantizable_or_unknown(arg)}
        dropped += len(annotation.input_qspec_map) - len(kept)
        annotation.input_qspec_map = kept
    return dropped
