"""What locate counts as a node's divergence besides a number over the tolerance: another kind of
dtype or another shape than torch's (`compare.unlike`), a one-sided NaN (`compare.error`), and the
op a multi-output op's item came from (`nodes.divergence_at`)."""

from __future__ import annotations

import operator

import torch

from compiler.tools.locate import compare, nodes


def test_another_kind_of_dtype_diverges_another_precision_does_not():
    zeros = torch.zeros(2, 3)
    assert compare.unlike(zeros.bool(), zeros, 1e-4) == "dtype bool where torch gives float32"
    assert compare.unlike(zeros.int(), zeros, 1e-4) == "dtype int32 where torch gives float32"
    assert compare.unlike(zeros.half(), zeros, 1e-4) is None  # a float16 payload's compute precision
    assert compare.unlike(zeros.long(), zeros.int(), 1e-4) is None


def test_another_shape_diverges_unless_it_broadcasts_to_the_same_numbers():
    row = torch.arange(4.0).reshape(1, 4)
    assert compare.unlike(row, row.expand(4, 4), 1e-4) is None  # the same numbers as a view
    assert compare.error_as_consumed(row, row.expand(4, 4)) == 0.0
    other = torch.arange(16.0).reshape(1, 4, 4)
    assert compare.unlike(row, other, 1e-4) == "shape (1, 4) where torch gives (1, 4, 4)"
    assert compare.unlike(torch.zeros(3), torch.zeros(2, 4), 1e-4) == "shape (3,) where torch gives (2, 4)"


def test_equal_infinities_agree_and_a_one_sided_nan_is_infinitely_off():
    masked = torch.tensor([float("-inf"), 1.0, float("nan")])
    assert compare.error(masked, masked.clone()) == 0.0
    assert compare.error(torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0])) == float("inf")


def test_an_item_of_a_multi_output_op_is_named_as_the_op():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    sort = graph.call_function(torch.ops.aten.sort.default, (x,))
    values = graph.call_function(operator.getitem, (sort, 0))
    graph.output((values,))
    errors = nodes.NodeErrors({"x": 0.0, values.name: 7.0}, {"x": 1e-4, values.name: 1e-4})
    found = nodes.divergence_at(values, errors, [], "against eager")
    assert (found.node, found.op, found.output_error) == (sort.name, "aten.sort.default", 7.0)
    assert found.input_errors == (("x", 0.0),)
