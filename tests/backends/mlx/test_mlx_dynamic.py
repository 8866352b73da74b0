"""A dynamic sequence dimension on MLX: the payload runs at lengths other than the example's,
and a node whose stock handler would take a symbolic size as a number stays off the delegate
with a reason naming that dimension (else its guard fixed the size for the whole program)."""

import torch

import compiler
from dynamic_shape_models import causal_attention, largest_errors, position_gather, symbolic_input_dims

TOLERANCE = 1e-4


def test_causal_attention_runs_at_other_lengths():
    model, inputs, dynamic = causal_attention()
    result = compiler.compile(model, inputs, "mlx", dynamic_shapes=dynamic)
    assert result.program.delegates == ("MLXBackend",)
    assert max(largest_errors(result, model, inputs).values()) < TOLERANCE


def test_an_index_with_a_dynamic_result_is_delegated_and_runs_at_other_lengths():
    """Stock's index handler reshapes to its output shape taken as ints: ours infers the one dynamic size."""
    model, inputs, dynamic = position_gather()
    result = compiler.compile(model, inputs, "mlx", dynamic_shapes=dynamic)
    assert symbolic_input_dims(result.stages["lower"].program)
    (index,) = [row for row in result.report.placement if row.op == "aten.index.Tensor"]
    assert index.where == "MLXBackend", index
    assert max(largest_errors(result, model, inputs).values()) < TOLERANCE


class GatherOfTwoDynamicSizes(torch.nn.Module):
    def forward(self, x):
        rows, cols = torch.arange(x.shape[0]), torch.arange(x.shape[1])
        return x[rows[:, None], cols[None, :]] * 2


def test_a_handler_that_would_fix_a_size_stays_on_the_cpu_and_says_why():
    """An index result with two dynamic sizes is more than one inferred size: stock's handler
    takes them as numbers, which would fix them; refused, it names the dimensions."""
    model, inputs = GatherOfTwoDynamicSizes(), (torch.randn(6, 8),)
    dynamic = ({0: torch.export.Dim("n", min=2, max=16), 1: torch.export.Dim("m", min=2, max=16)},)
    result = compiler.compile(model, inputs, "mlx", dynamic_shapes=dynamic)
    assert len(symbolic_input_dims(result.stages["lower"].program)) == 2
    (index,) = [row for row in result.report.placement if row.op == "aten.index.Tensor"]
    assert index.where == "cpu", index
    assert "takes the dynamic size x's dim 0 (s" in index.reason and "2..16" in index.reason, index.reason
    (got,) = compiler.run(result, (torch.randn(3, 11),))
    assert got.shape == (3, 11)


class GatherAcrossADynamicDim(torch.nn.Module):
    def forward(self, x, rows, cols):
        return x[rows, :, cols] * 2


def test_stock_refusal_of_a_dynamic_size_names_the_dimension():
    """Stock 1.5.1's multi-index gather refuses a dynamic non-indexed dimension by its symbol only."""
    inputs = (torch.randn(3, 8, 5), torch.tensor([0, 2]), torch.tensor([1, 4]))
    dynamic = ({1: torch.export.Dim("n", min=2, max=16)}, None, None)
    result = compiler.compile(GatherAcrossADynamicDim(), inputs, "mlx", dynamic_shapes=dynamic)
    (index,) = [row for row in result.report.placement if row.op == "aten.index.Tensor"]
    assert index.where == "cpu" and "dynamic size x's dim 1 (s" in index.reason and "2..16" in index.reason, index
