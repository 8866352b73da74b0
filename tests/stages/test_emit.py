"""The emit stage: `.pte` bytes that carry what the program needs, including initial state."""

import pytest
import torch

import compiler
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime


class RunningTotal(torch.nn.Module):
    def __init__(self, start: float):
        super().__init__()
        self.register_buffer("total", torch.full((4, 8), start))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 1.0


def test_stock_emits_a_mutated_buffer_without_its_initial_value():
    model, x = RunningTotal(2.0), torch.randn(4, 8)
    with torch.no_grad():
        ep = torch.export.export(model, (x,))
    pte = to_edge_transform_and_lower(ep).to_executorch().buffer
    (out,) = Runtime.get().load_program(pte).load_method("forward").execute([x])
    torch.testing.assert_close(out, x)  # the state started at zero, not at 2.0


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_mutated_buffer_keeps_its_initial_value(backend):
    x = torch.randn(4, 8)
    artifact = compiler.compile(RunningTotal(2.0), (x,), backend)
    assert artifact.report.stage("emit").metrics["initialized_state"] == 1
    (out,) = compiler.run(artifact, (x,))
    torch.testing.assert_close(out, RunningTotal(2.0)(x))


def test_zero_initial_state_is_not_stored():
    x = torch.randn(4, 8)
    artifact = compiler.compile(RunningTotal(0.0), (x,), "portable")
    assert "initialized_state" not in artifact.report.stage("emit").metrics
    (out,) = compiler.run(artifact, (x,))
    torch.testing.assert_close(out, x)
