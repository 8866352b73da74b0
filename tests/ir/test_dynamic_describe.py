"""How a placement reason names a dynamic size."""

import torch

from compiler.ir import dynamic


class _Nonzero(torch.nn.Module):
    def forward(self, x):
        return torch.nonzero(x) * 2


def test_a_size_no_input_holds_is_named_data_dependent_once():
    program = torch.export.export(_Nonzero(), (torch.tensor([1.0, 0.0, 2.0]),))
    symbol = next(
        str(s) for node in program.graph.nodes if isinstance(node.meta.get("val"), torch.Tensor)
        for size in node.meta["val"].shape if isinstance(size, torch.SymInt) for s in size.node.expr.free_symbols
    )
    assert symbol.startswith("u")
    text = dynamic.describe(program.graph, symbol)
    assert text.startswith(symbol) and "dynamic size" not in text, text
