"""`legalize_in_place` leaves a graph as torch's `legalize_graph` does (node order, each node's
users order, names), without copying it; the lower stage uses it inside `to_backend`."""

from __future__ import annotations

import copy
import operator

import torch
from torch.fx.passes.tools_common import legalize_graph

from compiler.ir.graph import legalize_in_place
from compiler.models.examples import Transformer


def _state(gm: torch.fx.GraphModule) -> tuple[list[str], dict[str, list[str]]]:
    return [n.name for n in gm.graph.nodes], {n.name: [u.name for u in n.users] for n in gm.graph.nodes}


class Branches(torch.nn.Module):
    def forward(self, x, y):
        a = torch.relu(x)
        b = torch.sigmoid(y)
        c = a + b
        d = torch.tanh(a) * c
        return d - b, c


def _scrambled() -> torch.fx.GraphModule:
    """A graph as a fusion leaves it: a new node at the end taking over uses of earlier ones,
    so nodes are out of topological order and users are not in graph order."""
    gm = torch.fx.symbolic_trace(Branches())
    nodes = {n.name: n for n in gm.graph.nodes}
    with gm.graph.inserting_before(gm.graph.output_node()):
        fused = gm.graph.call_function(operator.add, (nodes["relu"], nodes["sigmoid"]))
    nodes["add"].replace_all_uses_with(fused)
    gm.graph.erase_node(nodes["add"])
    return gm


def test_the_same_order_and_users_as_legalize_graph_twice_over():
    stock, ours = _scrambled(), _scrambled()
    for _ in range(2):  # the second sort depends on the users order the first one left
        legalize_graph(stock)
        assert legalize_in_place(ours)
        assert _state(ours) == _state(stock)


def test_a_reserved_name_is_left_to_legalize_graph():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    placeholder = next(iter(gm.graph.nodes))
    placeholder.name = "input"  # what `copy_program` puts back after FX's copy renamed it
    before = _state(gm)
    assert not legalize_in_place(gm)
    assert _state(gm) == before


def _moved_to_the_end(gm: torch.fx.GraphModule, every: int) -> torch.fx.GraphModule:
    """Every `every`-th op re-created just before the output, taking over its uses: the graph
    out of order, its inputs' users no longer in graph order."""
    ops = [n for n in gm.graph.nodes if n.op == "call_function"][::every]
    for node in ops:
        with gm.graph.inserting_before(gm.graph.output_node()):
            moved = gm.graph.call_function(node.target, node.args, node.kwargs)
        moved.meta = dict(node.meta)
        node.replace_all_uses_with(moved)
        gm.graph.erase_node(node)
    return gm


def test_an_exported_program_sorted_in_place_like_legalize_graph():
    program = torch.export.export(Transformer(2, 32, 2).eval(), (torch.randn(1, 8, 32),))
    stock = _moved_to_the_end(copy.deepcopy(program.graph_module), 7)
    ours = _moved_to_the_end(copy.deepcopy(program.graph_module), 7)
    for _ in range(2):
        legalize_graph(stock)
        assert legalize_in_place(ours)
        assert _state(ours) == _state(stock)
    ours.recompile()
    assert ours.code == stock.code
