"""GELU with approximate="tanh": stock XNNPACK computes the exact GELU (its visitor passes no mode)."""

import pytest
import torch
import torch.nn.functional as F

import compiler


class Gelu(torch.nn.Module):
    def __init__(self, approximate):
        super().__init__()
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(x * 2.0, approximate=self.approximate)


def _inputs():
    return (torch.linspace(-6, 6, 1200).reshape(4, 300),)


def test_stock_xnnpack_computes_tanh_gelu_exactly():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    model, args = Gelu("tanh"), _inputs()
    pte = to_edge_transform_and_lower(torch.export.export(model, args), partitioner=[XnnpackPartitioner()]).to_executorch().buffer
    (stock,) = Runtime.get().load_program(pte).load_method("forward").execute(list(args))
    assert (stock - model(*args)).abs().max() > 1e-4  # silently the other GELU
    torch.testing.assert_close(stock, Gelu("none")(*args))


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_matches_eager_in_both_modes_and_stays_delegated(approximate):
    model, args = Gelu(approximate), _inputs()
    artifact = compiler.compile(model, args, "xnnpack")
    (got,) = compiler.run(artifact, args)
    torch.testing.assert_close(got, model(*args), rtol=0, atol=2e-6)
    assert not artifact.program.plan.cpu_nodes
