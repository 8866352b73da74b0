"""Core ML's PT2E quantizer (ExecuTorch's CoreMLQuantizer over coremltools' configuration),
annotating floating-point values only (`compiler.backends.pt2e`)."""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch

from compiler.backends.pt2e import drop_unquantizable_annotations


# ExecuTorch's CoreMLQuantizer builds the graph of each pattern it matches (a conv, linear or
# binary op, with each activation it may fuse) with torch.export at every `annotate`: 2.5-8
# minutes a call on a real model. A pattern's graph depends only on its maker's arguments.
_PATTERN_MAKERS = (
    "get_conv_pattern", "get_conv_bn_pattern", "get_linear_pattern", "get_linear_bn_pattern",
    "get_binary_op_act_pattern",
)


def _made_once(maker: Callable) -> Callable:
    """`maker` memoized, handing out a copy: the matcher rewrites the pattern graph it is given
    (it splits its output tuple)."""
    made = functools.cache(maker)

    @functools.wraps(maker)
    def copy_of_made(*args: Any, **kwargs: Any) -> Any:
        return copy.deepcopy(made(*args, **kwargs))

    copy_of_made.made_once = True
    return copy_of_made


def _pattern_graphs_made_once() -> None:
    """Each pattern graph made once per process, where the quantizer looks its makers up."""
    from executorch.backends.apple.coreml.quantizer import _coreml_quantizer_utils as makers

    for name in _PATTERN_MAKERS:
        maker = getattr(makers, name, None)  # another ExecuTorch may name them otherwise: no cache, as stock
        if maker is not None and not getattr(maker, "made_once", False):
            setattr(makers, name, _made_once(maker))


def pt2e_quantizer(static_activations: bool) -> Any:
    """Symmetric int8 weights per channel; activations int8 from calibration when
    `static_activations`, else float."""
    import coremltools as ct
    from executorch.backends.apple.coreml.quantizer import CoreMLQuantizer

    _pattern_graphs_made_once()

    class FloatOnlyCoreMLQuantizer(CoreMLQuantizer):
        def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
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
