"""CoreMLQuantizer's pattern graphs are made once per process: it exported each (torch.export,
hundreds of them) at every annotate, minutes a call on a real model."""

import pytest
import torch

from compiler.backends.coreml.quantizer import pt2e_quantizer


def _annotations(graph):
    return [
        (node.name, sorted(a.name for a in node.meta["quantization_annotation"].input_qspec_map))
        for node in graph.graph.nodes if "quantization_annotation" in node.meta
    ]


@pytest.mark.slow  # the first annotate exports every pattern graph (about a minute)
def test_a_second_annotate_exports_no_pattern_and_annotates_the_same(monkeypatch):
    from executorch.backends.apple.coreml.quantizer import _coreml_quantizer_utils as makers

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    inputs = (torch.randn(2, 8),)
    first = torch.export.export(model, inputs).module()
    pt2e_quantizer(static_activations=True).annotate(first)
    exported = []
    original = makers._get_aten_graph_module
    monkeypatch.setattr(makers, "_get_aten_graph_module", lambda *a, **k: exported.append(1) or original(*a, **k))
    second = torch.export.export(model, inputs).module()
    pt2e_quantizer(static_activations=True).annotate(second)
    assert exported == []
    assert _annotations(second) == _annotations(first) != []
