"""The Core ML lower skips coremltools' per-pass re-propagation only where it changes nothing:
the payload is the same byte for byte as with every propagation run, for a plain program
(where it is skipped) and for a weight-quantized one (whose `constexpr_` weights make it run)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import compiler
import compiler.backends.coreml as coreml_backend
from compiler.ir import private_api


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(32, 64)
        self.second = nn.Linear(64, 16)

    def forward(self, x):
        return self.second(torch.nn.functional.gelu(self.first(x)))


def _compile(quantize: str | None) -> bytes:
    torch.manual_seed(0)
    model, x = TwoLinears().eval(), torch.randn(2, 32)
    options = {"quantize": quantize, "calibration": [(x,)]} if quantize else {}
    return compiler.compile(model, (x,), "coreml", **options).pte


def _calls(monkeypatch) -> dict[str, int]:
    """Counts of the skip's check and of coremltools' own propagation."""
    from coremltools.converters.mil.mil import Block

    counts = {"checked": 0, "skipped": 0, "propagated": 0}
    check, propagate = private_api._without_nonreplaceable_vars, Block._propagate_nonreplaceable_vars

    def counted_check(function):
        counts["checked"] += 1
        answer = check(function)
        counts["skipped"] += answer
        return answer

    def counted_propagate(block):
        counts["propagated"] += 1
        return propagate(block)

    monkeypatch.setattr(private_api, "_without_nonreplaceable_vars", counted_check)
    monkeypatch.setattr(Block, "_propagate_nonreplaceable_vars", counted_propagate)
    return counts


@pytest.mark.parametrize("quantize", [None, "8w"])
def test_payload_is_the_same_as_with_every_propagation(quantize, monkeypatch):
    counts = _calls(monkeypatch)
    skipping = _compile(quantize)
    assert counts["checked"] > 0
    if quantize:
        # Once a pass makes the weights constexpr_ ops, every propagation after it runs.
        assert 0 < counts["propagated"] and counts["skipped"] < counts["checked"]
    else:
        assert counts["skipped"] == counts["checked"]
    monkeypatch.setattr(coreml_backend, "mil_idle_work_skipped", contextlib.nullcontext)
    assert _compile(quantize) == skipping
