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
from mil_breakage import break_gelu_converter, break_in_pass


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x))


def _small():
    torch.manual_seed(0)
    return Small().eval(), (torch.randn(2, 4),)


def _break_pass(monkeypatch) -> None:
    break_in_pass(monkeypatch, "nn_backend::handle_unused_inputs")


@pytest.mark.parametrize("break_conversion", [break_gelu_converter, _break_pass], ids=["converter", "pass"])
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
