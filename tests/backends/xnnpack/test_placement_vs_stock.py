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
from compiler.private_api import deserialize_pte


class Lstm(torch.nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.lstm = torch.nn.LSTM(8, 16, num_layers=layers, batch_first=True)

    def forward(self, x):
        return self.lstm(x)[0]


def placement_counts(pte: bytes) -> tuple[int, int, collections.Counter]:
    """(delegate calls, CPU kernel calls, CPU op name -> calls) of a `.pte`."""
    plan = deserialize_pte(pte).program.execution_plan[0]
    delegates, ops = 0, collections.Counter()
    for chain in plan.chains:
        for instruction in chain.instructions:
            kind = type(instruction.instr_args).__name__
            if kind == "DelegateCall":
                delegates += 1
            elif kind == "KernelCall":
                ops[plan.operators[instruction.instr_args.op_index].name] += 1
    return delegates, sum(ops.values()), ops


def _stock(model, args) -> bytes:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = to_edge_transform_and_lower(torch.export.export(model, args), partitioner=[XnnpackPartitioner()])
    return program.to_executorch().buffer


@pytest.mark.parametrize("layers, steps", [(1, 6), (2, 4)])
def test_lstm_placement_no_worse_than_stock(layers, steps):
    torch.manual_seed(0)
    model, args = Lstm(layers).eval(), (torch.randn(1, steps, 8),)
    artifact = compiler.compile(model, args, "xnnpack")
    ours, stock = placement_counts(artifact.pte), placement_counts(_stock(model, args))
    assert ours[0] <= stock[0], f"delegates: ours {ours[0]}, stock {stock[0]}"
    assert ours[1] <= stock[1], f"CPU ops: ours {ours[2]}, stock {stock[2]}"
    assert not {"aten::addmm", "aten::mm"} & set(ours[2]), ours[2]
    assert artifact.program.delegate_calls == ours[0] and artifact.program.kernel_calls == ours[1]
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
