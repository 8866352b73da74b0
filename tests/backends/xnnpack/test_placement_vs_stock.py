"""Placement no worse than stock: an LSTM on XNNPACK.

`aten.lstm` is one node of the captured program; its decomposition makes the `linear`s
XNNPACK asks to keep whole. Asked only of the captured nodes, the keep-whole plan missed
them: each linear decomposed to `permute_copy` + `addmm`, whose weight (a permuted
parameter) XNNPACK's AddmmConfig refuses ("Expected weight to be a static param"), so every
step's matrix multiply ran on the CPU and split the delegates (14 against stock's 8 for
one layer, 27 against 15 for two)."""

import collections

import pytest
import torch

import compiler
from compiler.stages.emit import pte_calls


class Lstm(torch.nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.lstm = torch.nn.LSTM(8, 16, num_layers=layers, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


def _stock(model, args) -> bytes:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = to_edge_transform_and_lower(torch.export.export(model, args), partitioner=[XnnpackPartitioner()])
    return program.to_executorch().buffer


# The default run takes one layer of three steps; `-m slow` adds six steps and two layers (the
# slowest compiles of the file: the LSTM is unrolled, a cell per step).
@pytest.mark.parametrize(
    "layers, steps", [(1, 3), pytest.param(1, 6, marks=pytest.mark.slow), pytest.param(2, 4, marks=pytest.mark.slow)]
)
def test_lstm_placement_no_worse_than_stock(layers, steps):
    torch.manual_seed(0)
    model, args = Lstm(layers).eval(), (torch.randn(1, steps, 8),)
    artifact = compiler.compile(model, args, "xnnpack")
    ours, stock = pte_calls(artifact.pte), pte_calls(_stock(model, args))
    assert ours.delegates <= stock.delegates, f"delegates: ours {ours.delegates}, stock {stock.delegates}"
    assert ours.cpu_calls <= stock.cpu_calls, f"CPU ops: ours {ours.cpu_ops}, stock {stock.cpu_ops}"
    assert not {"aten::addmm", "aten::mm"} & set(ours.cpu_ops), ours.cpu_ops
    assert artifact.program.delegate_calls == ours.delegates and artifact.program.kernel_calls == ours.cpu_calls
    (got,) = compiler.run(artifact, args)
    torch.testing.assert_close(got, model(*args), rtol=1e-5, atol=1e-5)


def test_the_dry_run_opens_the_lstm_and_keeps_its_linears_whole():
    model, args = Lstm(1).eval(), (torch.randn(1, 4, 8),)
    artifact = compiler.compile(model, args, "xnnpack")
    planned = artifact.stages["dry_run"]
    ops = collections.Counter(str(n.target) for n in planned.program.graph.nodes if n.op == "call_function")
    assert "aten.lstm.input" not in ops
    assert ops["aten.linear.default"] == 5  # the input projection, and one per step
    assert len(planned.keep_whole.nodes) == 5
