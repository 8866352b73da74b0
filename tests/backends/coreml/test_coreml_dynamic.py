"""A dynamic sequence dimension on Core ML: the payload declares the input's size as a range
with the declared bounds (coremltools' RangeDim, from the program's range constraints), and
the program runs at other lengths in the MIL interpreter."""

import torch
import torch.nn.functional as F

import compiler
from dynamic_shape_models import causal_attention, largest_errors

from compiler.backends.coreml.payload import coreml_payloads, input_size_ranges


def test_causal_attention_declares_the_range_and_runs_at_other_lengths():
    model, inputs, dynamic = causal_attention()
    result = compiler.compile(model, inputs, "coreml", dynamic_shapes=dynamic)
    (payload,) = coreml_payloads(result.pte)
    (ranges,) = input_size_ranges(payload).values()
    assert ranges == [(1, 1), (2, 32)]
    assert max(largest_errors(result, model, inputs).values()) < 3e-3  # computed in float16


class DoubledRows(torch.nn.Module):
    """SDPA over 2*n rows read from the CPU (log1p): Core ML takes an input size only as one symbol."""

    def forward(self, x):
        rows = torch.log1p(torch.cat([x, x]).abs())
        q = rows.view(1, 1, rows.shape[0], 8)
        return F.scaled_dot_product_attention(q, q, q)


def test_a_size_expression_kept_off_core_ml_names_the_dimension():
    model, inputs = DoubledRows(), (torch.rand(3, 8),)
    result = compiler.compile(model, inputs, "coreml", dynamic_shapes=({0: torch.export.Dim("n", min=2, max=64)},))
    reasons = [row.reason for row in result.report.placement if "sized 2*s" in row.reason]
    assert reasons and all("x's dim 0 (s" in r and "2..64" in r for r in reasons), reasons
