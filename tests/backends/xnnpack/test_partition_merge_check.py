"""The partition search's merge check in time that does not grow with the program and memory
of n^2 bits (`private_api.partition_merges_checked_by_bits`) gives stock's answers: the same tags."""

from __future__ import annotations

import copy

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge

from compiler.ir.graph import DELEGATION_TAG
from compiler.ir import private_api
from compiler.ir.private_api import partition_merges_checked_by_bits
from compiler.models.examples import Transformer


def _tags(program) -> dict[str, str]:
    XnnpackPartitioner().partition(program)
    return {n.name: n.meta[DELEGATION_TAG] for n in program.graph.nodes if n.meta.get(DELEGATION_TAG)}


def test_the_same_partitions_as_stocks_check():
    torch.manual_seed(0)
    model = Transformer(3, 32, 2).eval()
    edge = to_edge(torch.export.export(model, (torch.randn(1, 8, 32),))).exported_program()
    stock = _tags(copy.deepcopy(edge))
    viewers = []
    bits = private_api._ReachabilityBits

    class Recorded(bits):
        def __init__(self, graph_module):
            super().__init__(graph_module)
            viewers.append(self)

    private_api._ReachabilityBits = Recorded
    try:
        with partition_merges_checked_by_bits():
            ours = _tags(copy.deepcopy(edge))
    finally:
        private_api._ReachabilityBits = bits
    assert viewers  # the partitioner used the bits, not stock's sets
    assert len(set(stock.values())) > 3  # CPU ops between the delegates: merges refused and made
    assert ours == stock


def test_reachability_bits_match_stocks_downstream_sets():
    from executorch.exir.backend.canonical_partitioners.group_partitioner import _DependencyViewer

    torch.manual_seed(0)
    edge = to_edge(torch.export.export(Transformer(2, 32, 2).eval(), (torch.randn(1, 8, 32),))).exported_program()
    stock, ours = _DependencyViewer(edge.graph_module), private_api._ReachabilityBits(edge.graph_module)
    for node in edge.graph.nodes:
        assert ours.downstreams_of(node) == stock.downstreams_of(node)
