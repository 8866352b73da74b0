"""One XNNPACK partition search looks up each linear's source partitions and the program's
constant inputs once (`private_api.partition_search_lookups_memoized`), with stock's tags."""

from __future__ import annotations

import copy

import torch
from executorch.backends.xnnpack.partition.config import gemm_configs
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge

from compiler.ir.graph import DELEGATION_TAG
from compiler.ir.private_api import partition_search_lookups_memoized
from compiler.models.examples import Transformer


def _tags(program) -> dict[str, str]:
    XnnpackPartitioner().partition(program)
    return {n.name: n.meta[DELEGATION_TAG] for n in program.graph.nodes if n.meta.get(DELEGATION_TAG)}


def test_lookups_made_once_with_stocks_tags(monkeypatch):
    torch.manual_seed(0)
    edge = to_edge(torch.export.export(Transformer(3, 32, 2).eval(), (torch.randn(1, 8, 32),))).exported_program()
    calls = []
    lookup = gemm_configs.get_source_partitions

    def counted(*args, **kwargs):
        calls.append(args[1:])
        return lookup(*args, **kwargs)

    monkeypatch.setattr(gemm_configs, "get_source_partitions", counted)
    stock = _tags(copy.deepcopy(edge))
    asked = len(calls)
    calls.clear()
    with partition_search_lookups_memoized():
        ours = _tags(copy.deepcopy(edge))
    assert ours == stock and len(set(stock.values())) > 3
    assert asked > 10 and len(calls) == len({tuple(map(tuple, c)) for c in calls}) < asked
