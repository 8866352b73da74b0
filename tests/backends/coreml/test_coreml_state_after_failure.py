"""A Core ML conversion that fails leaves no coremltools state behind: later compiles in the
process give the same `.pte` as before it, byte for byte.

coremltools names the MIL ops it builds from process-wide counters (`Builder.name_count`)
that it resets only after a conversion succeeds; one that failed mid-way used to leave them
counting, so every later payload named its ops differently."""

from __future__ import annotations

import pytest
import torch

import compiler
from compiler.ir.errors import StageFailure


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x))


def _small():
    torch.manual_seed(0)
    return Small().eval(), (torch.randn(2, 4),)


def _break_block(var) -> None:
    """Leave the MIL block invalid: `var` claims an op reads it that does not (as
    tests/stages/test_lower_validation.py does)."""
    var.add_child_op(var.op)


def _break_converter(monkeypatch) -> None:
    from compiler.ir.private_api import coreml_converters

    registry = coreml_converters()
    gelu = registry["gelu"]

    def broken_gelu(context, node):
        gelu(context, node)
        _break_block(context[node.name])

    monkeypatch.setitem(registry, "gelu", broken_gelu)


def _break_pass(monkeypatch) -> None:
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    graph_pass = type(PASS_REGISTRY["nn_backend::handle_unused_inputs"])
    apply = graph_pass.apply

    def apply_and_break(self, prog):
        apply(self, prog)
        op = next(op for op in prog.functions["main"].operations if op.op_type != "const")
        _break_block(op.outputs[0])

    monkeypatch.setattr(graph_pass, "apply", apply_and_break)


@pytest.mark.parametrize("break_conversion", [_break_converter, _break_pass], ids=["converter", "pass"])
def test_compiles_after_a_failed_conversion_are_byte_identical(break_conversion):
    before = compiler.compile(*_small(), "coreml").pte
    with pytest.MonkeyPatch.context() as monkeypatch:
        break_conversion(monkeypatch)
        with pytest.raises(StageFailure) as failure:
            compiler.compile(*_small(), "coreml")
    assert type(failure.value.__cause__).__name__ == "InvalidBlockStateError"
    first = compiler.compile(*_small(), "coreml").pte
    second = compiler.compile(*_small(), "coreml").pte
    assert first == second
    assert first == before
