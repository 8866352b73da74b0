"""Core ML's PT2E quantizer (ExecuTorch's CoreMLQuantizer over coremltools' configuration),
annotating floating-point values only (`compiler.backends.pt2e`), its pattern graphs made once
per process (`private_api.coreml_pattern_graphs_made_once`), and only the patterns whose op the
model holds matched (`private_api.coreml_annotators_for`)."""

from __future__ import annotations

from typing import Any

import torch

from compiler.backends.pt2e import drop_unquantizable_annotations
from compiler.ir.private_api import coreml_annotators_for, coreml_pattern_graphs_made_once


def pt2e_quantizer(static_activations: bool) -> Any:
    """Symmetric int8 weights per channel; activations int8 from calibration when
    `static_activations`, else float."""
    import coremltools as ct
    from executorch.backends.apple.coreml.quantizer import CoreMLQuantizer

    coreml_pattern_graphs_made_once()

    class FloatOnlyCoreMLQuantizer(CoreMLQuantizer):
        def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            with coreml_annotators_for(model.graph):  # those whose op the model holds
                model = super().annotate(model)
            drop_unquantizable_annotations(model)
            return model

    activation = torch.quint8 if static_activations else torch.float32
    config = ct.optimize.torch.quantization.LinearQuantizerConfig(
        global_config=ct.optimize.torch.quantization.ModuleLinearQuantizerConfig(
            quantization_scheme="symmetric", activation_dtype=activation, weight_dtype=torch.qint8,
            weight_per_channel=True,
        )
    )
    return FloatOnlyCoreMLQuantizer(config)
