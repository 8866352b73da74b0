"""XNNPACK elides copies: one whose result leaves the delegate runs on the CPU."""

import pytest
import torch

import compiler


class CopyThenWrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 6)

    def forward(self, x):
        y = self.linear(x)
        z = y.clone()
        z[torch.tensor([0, 2])] = 0.5
        return z, y


def test_a_copy_used_outside_the_delegate_runs_on_the_cpu():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    model, x = CopyThenWrite().eval(), torch.randn(3, 4)
    with pytest.raises(Exception, match="already in the inputs"):
        to_edge_transform_and_lower(torch.export.export(model, (x,)), partitioner=[XnnpackPartitioner()])
    artifact = compiler.compile(model, (x,), "xnnpack")
    for got, want in zip(compiler.run(artifact, (x,)), model(x), strict=True):
        torch.testing.assert_close(got, want)
