"""The decompose stage: one decomposition, kept-whole ops, a pure Edge program."""

import torch

import compiler
from compiler.backends.base import Backend, BackendPartition, KeepWhole
from compiler.ir.dialect import ATEN, op_dialect, op_name
from compiler.stages.base import StageContext
from compiler.stages.decompose import Decompose
from executorch.exir import to_edge


class MaskedAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x, mask):
        return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]


def inputs():
    return torch.randn(1, 4, 16), torch.tensor([[False, True, False, False]] * 4)


def test_stock_to_edge_leaves_an_aten_op_in_the_edge_program():
    with torch.no_grad():
        ep = torch.export.export(MaskedAttention().eval(), inputs())
    edge = to_edge(ep).exported_program()
    left = [op_name(n.target) for n in edge.graph.nodes if n.op == "call_function" and op_dialect(n.target) == ATEN]
    assert left == ["aten.scalar_tensor.default"]


def test_masked_attention_becomes_a_pure_edge_program_and_matches_eager():
    model, args = MaskedAttention().eval(), inputs()
    artifact = compiler.compile(model, args, "portable")
    edge = artifact.stages["decompose"].program
    assert not [n for n in edge.graph.nodes if n.op == "call_function" and op_dialect(n.target) == ATEN]
    assert compiler.compare_with_eager(artifact, model, args).max_abs_error < 1e-5


class KeepLinear(Backend):
    name = "keep-linear"

    def keep_whole(self, program):
        return KeepWhole(frozenset({torch.ops.aten.linear.default}), lambda node: node.name == "linear")

    def partition(self, program):
        return BackendPartition({})


def test_node_filter_keeps_only_accepted_nodes_whole_and_leaves_the_input_unchanged():
    class TwoLinears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    planned = compiler.compile(TwoLinears(), (torch.randn(2, 4),), KeepLinear(), stop_after="dry_run")
    assert planned.keep_whole.nodes == {"linear"}
    before = [n.target for n in planned.program.graph.nodes]
    edge = Decompose().run(planned, StageContext(KeepLinear()))
    ops = [op_name(n.target) for n in edge.program.graph.nodes if n.op == "call_function"]
    assert ops.count("aten.linear.default") == 1  # only the node the filter accepted
    assert "aten.addmm.default" in ops  # the other one decomposed
    assert [n.target for n in planned.program.graph.nodes] == before
    assert edge.preserved_ops == ("aten.linear.default",)
