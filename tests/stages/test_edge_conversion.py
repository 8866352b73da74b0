"""Our Edge conversion runs ExecuTorch's passes, skipping those that cannot apply:
the result must be exactly what stock's conversion gives, once the ATen ops stock
leaves behind are made Edge ops."""

import pytest
import torch

import compiler
from compiler.examples import transformer
from compiler.stages.decompose import decompose
from compiler.stages.edge_conversion import _finish_edge_ops, generate_edge_program
from executorch.exir import EdgeCompileConfig
from executorch.exir.program._program import _generate_edge_program


class MixedTypes(torch.nn.Module):
    def forward(self, x, n):
        return (n * 1.5 + x).t(), n // 2 + 1, (x > 0) * 3


class SymbolicSize(torch.nn.Module):
    def forward(self, x):
        return x * x.shape[0] + torch.ones(1) * x.shape[0]


def cases():
    dim = torch.export.Dim("batch", min=2, max=32)
    return [
        ("transformer", *transformer(depth=1), None),
        ("mixed", MixedTypes(), (torch.randn(3, 3), torch.randint(0, 9, (3, 3))), None),
        ("symbolic", SymbolicSize(), (torch.randn(4, 3),), ({0: dim},)),
    ]


@pytest.mark.parametrize("name, model, inputs, dynamic", cases(), ids=[c[0] for c in cases()])
def test_same_program_as_stock_conversion(name, model, inputs, dynamic):
    aten = compiler.compile(model, inputs, "xnnpack", stop_after="fold", dynamic_shapes=dynamic).program
    keep = {n.name for n in aten.graph.nodes if n.target == torch.ops.aten.linear.default}
    program, preserved = decompose(aten, keep)
    stock = _generate_edge_program(EdgeCompileConfig(), program, preserve_ops=preserved)
    _finish_edge_ops(stock)  # the one intended difference: leftover ATen ops become Edge ops
    program, preserved = decompose(aten, keep)
    ours, skipped = generate_edge_program(program, preserved)
    assert ours.graph_module.code == stock.graph_module.code
    assert str(ours.graph_signature) == str(stock.graph_signature)
    expected_to_run = {"mixed": "RemoveMixedTypeOperators", "symbolic": "SymToTensorPass"}
    if name in expected_to_run:
        assert expected_to_run[name] not in skipped
    else:
        assert {"RemoveMixedTypeOperators", "SymToTensorPass", "ReplaceBrokenOpsWithFunctionalOpsPass"} <= set(skipped)
