"""The partition search's merge check in time that does not grow with the program
(`private_api.partition_merges_checked_by_sets`) gives stock's answers: the same tags."""

from __future__ import annotations

import copy

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge

from compiler.ir.graph import DELEGATION_TAG
from compiler.ir.private_api import partition_merges_checked_by_sets
from compiler.models.examples import Transformer


def _tags(program) -> dict[str, str]:
    XnnpackPartitioner().partition(program)
    return {n.name: n.meta[DELEGATION_TAG] for n in program.graph.nodes if n.meta.get(DELEGATION_TAG)}


def test_the_same_partitions_as_stocks_check():
    torch.manual_seed(0)
    model = Transformer(3, 32, 2).eval()
    edge = to_edge(torch.export.export(model, (torch.randn(1, 8, 32),))).exported_program()
    stock = _tags(copy.deepcopy(edge))
    with partition_merges_checked_by_sets():
        ours = _tags(copy.deepcopy(edge))
    assert len(set(stock.values())) > 3  # CPU ops between the delegates: merges refused and made
    assert ours == stock
