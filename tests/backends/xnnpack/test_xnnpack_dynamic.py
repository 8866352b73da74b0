"""A dynamic sequence dimension on XNNPACK: the program runs at other lengths, and a view whose
target size holds the dynamic size runs on the CPU with a reason naming the dimension (stock
says 'invalid dtype' of it)."""

import pytest

import compiler
from dynamic_shape_models import causal_attention, largest_errors


@pytest.mark.slow
def test_causal_attention_runs_at_other_lengths_and_says_why_views_stay_on_the_cpu():
    model, inputs, dynamic = causal_attention()
    result = compiler.compile(model, inputs, "xnnpack", dynamic_shapes=dynamic)
    assert "XnnpackBackend" in result.program.delegates
    assert max(largest_errors(result, model, inputs).values()) < 1e-4
    views = [row for row in result.report.placement if row.op == "aten.view_copy.default"]
    assert views and all(row.where == "cpu" for row in views)
    assert all("ids's dim 1 (s" in row.reason and "2..32" in row.reason for row in views), views
