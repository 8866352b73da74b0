"""coremltools' float16 pass keeps an op in float32 when one of its float32 constants holds a value
float16 cannot. Stock tests that with `np.where` over the whole constant (16 bytes of indices an
element: 6 GB at once for a 1B Llama's embedding table); the lower asks `fp16_overflows`, which
reads the constant a piece at a time. The answer must be stock's for every kind of value, and the
payload the same bytes."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch import nn

import compiler
import compiler.backends.coreml as coreml_backend
from compiler.ir import private_api

VALUES = {
    "small": [1.0, -2.5, 0.0],
    "float16's largest": [65504.0, -65504.0],
    "just over": [65504.0, 65505.0],
    "negative over": [-1e5, 3.0],
    "infinities": [np.inf, -np.inf, 1.0],
    "1e38 and over": [1e38, 3e38, -2e38],
    "just under 1e38": [9.9e37, 1.0],
    "nan": [np.nan, 1.0],
    "nan and over": [np.nan, 7e4],
    "scalar over": 7e4,
    "scalar inside": 7.0,
}


def _add_op(value):
    """A MIL add of an input and `value` as a float32 constant."""
    from coremltools.converters.mil import Builder as mb

    constant = np.array(value, dtype=np.float32)

    @mb.program(input_specs=[mb.TensorSpec(shape=constant.shape or (1,))])
    def program(x):
        return mb.add(x=x, y=constant)

    (op,) = [op for op in program.functions["main"].operations if op.op_type == "add"]
    return op


@pytest.mark.parametrize("case", list(VALUES))
def test_the_answer_is_stocks(case):
    from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision

    op = _add_op(VALUES[case])
    stock = FP16ComputePrecision.fp16_overflow(op)
    with private_api.fp16_overflow_checked_in_pieces():
        ours = FP16ComputePrecision.fp16_overflow(op)
    assert ours == stock


def test_an_overflow_in_a_later_piece_is_found(monkeypatch):
    monkeypatch.setattr(private_api, "_OVERFLOW_PIECE", 3)
    values = np.ones(10, dtype=np.float32)
    assert not private_api.fp16_overflows(values)
    values[8] = 1e5
    assert private_api.fp16_overflows(values)


class LargeWeight(nn.Module):
    """One Linear whose weight float16 holds, one whose weight it does not (it stays float32)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(32, 64), nn.Linear(64, 16)
        with torch.no_grad():
            self.second.weight[0, 0] = 1e5

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def test_the_payload_is_the_same_bytes(monkeypatch):
    torch.manual_seed(0)
    model, inputs = LargeWeight().eval(), (torch.randn(2, 32),)
    asked = []
    original = private_api.fp16_overflows
    monkeypatch.setattr(private_api, "fp16_overflows", lambda value: asked.append(original(value)) or asked[-1])
    ours = compiler.compile(model, inputs, "coreml").pte
    assert True in asked and False in asked  # the lower asked ours, of both weights
    monkeypatch.setattr(coreml_backend, "fp16_overflow_checked_in_pieces", contextlib.nullcontext)
    assert compiler.compile(model, inputs, "coreml").pte == ours
