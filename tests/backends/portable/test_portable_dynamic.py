"""A dynamic sequence dimension on the portable kernels: the program runs at other lengths."""

import compiler
from dynamic_shape_models import causal_attention, largest_errors


def test_causal_attention_runs_at_other_lengths():
    model, inputs, dynamic = causal_attention()
    result = compiler.compile(model, inputs, "portable", dynamic_shapes=dynamic)
    assert max(largest_errors(result, model, inputs, lengths=(2, 13, 32)).values()) < 1e-5
