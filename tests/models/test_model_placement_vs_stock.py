"""Placement at or above stock's where stock's program is right: one transformer per backend.

Before the Core ML rules rested on failures shown (tests/backends/coreml/test_rules.py),
BERT's 0-d fills and its padding mask's bool index ran on the CPU and cut its program in
two Core ML delegates, where stock's one delegate matched eager. The placement benchmark
(benchmarks/placement.py) compares every model; this samples one per backend.
"""

import pytest
import torch

pytest.importorskip("transformers")

import compiler
from compiler.models import model_suite
from compiler.tools.fuzz.oracle import stock_partitioners
from compiler.stages.emit import pte_calls

pytestmark = pytest.mark.models


def _stock(module, inputs, backend) -> bytes:
    from executorch.exir import to_edge_transform_and_lower

    with torch.no_grad():
        program = torch.export.export(module, inputs)
    return to_edge_transform_and_lower(program, partitioner=stock_partitioners(backend)).to_executorch().buffer


@pytest.mark.parametrize("name, backend", [("bert", "coreml"), ("mistral", "xnnpack"), ("clip_text", "mlx")])
def test_placement_at_or_above_stock(name, backend):
    module, inputs = model_suite.SUITE[name](layers=1)
    stock = _stock(module, inputs, backend)
    assert compiler.compare_with_eager(stock, module, inputs).passed  # stock is right here
    artifact = compiler.compile(module, inputs, backend)
    ours, theirs = pte_calls(artifact.pte), pte_calls(stock)
    assert ours.delegates <= theirs.delegates, f"delegates: ours {ours.delegates}, stock {theirs.delegates}"
    assert ours.cpu_calls <= theirs.cpu_calls, f"CPU ops: ours {ours.cpu_ops}, stock {theirs.cpu_ops}"
    assert compiler.compare_with_eager(artifact, module, inputs).passed
