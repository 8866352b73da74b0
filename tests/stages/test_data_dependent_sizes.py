"""A tensor of a data-dependent size in a dimension other than the first (a gather by
`torch.nonzero`, as a VLM picks its text tokens) reaches the emitter: stock's
`dim_order_from_stride` proves `16 < 16*u0` but not the converse and raised at emit on every
backend; ours orders such strides (a multiple of another stride is the larger) and the program
runs right for any count, 0 and 1 included."""

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

import compiler

slow = pytest.mark.slow


class TextTokens(torch.nn.Module):
    """The embeddings of the tokens whose id is not padding, projected and summed."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, embeds, ids):
        where = torch.nonzero(ids[0] > 0).reshape(-1)
        return self.proj(embeds[:, where]).sum(1)


IDS = torch.tensor([[1, 2, 0, 3, 4, 0, 1, 0]])


@pytest.mark.parametrize("backend", ["portable", pytest.param("xnnpack", marks=slow), "coreml",
                                     pytest.param("mlx", marks=slow)])
def test_a_gather_by_nonzero_compiles_and_runs_right_for_any_count(backend):
    model = TextTokens().eval()
    result = compiler.compile(model, (torch.randn(1, 8, 16), IDS), backend, cache=False)
    for ids in (IDS, torch.zeros(1, 8, dtype=torch.long), torch.tensor([[0, 0, 5, 0, 0, 0, 0, 0]]),
                torch.ones(1, 8, dtype=torch.long)):
        inputs = (torch.randn(1, 8, 16), ids)
        check = compiler.compare_with_eager(result, model, inputs)
        assert check.passed, (ids, check.describe())


def test_stock_raises_at_emit_on_the_data_dependent_stride():
    from executorch.exir import to_edge_transform_and_lower

    exported = torch.export.export(TextTokens().eval(), (torch.randn(1, 8, 16), IDS))
    with pytest.raises(GuardOnDataDependentSymNode, match=r"16\*u\d+ < 16"):
        to_edge_transform_and_lower(exported).to_executorch()


class SqueezedPositions(torch.nn.Module):
    """`nonzero`'s result squeezed: torch lays it out by column (strides (1, u0)), the runtime's
    kernel writes it by row, and the squeeze's kernel refuses two dim orders (error 0x12)."""

    def forward(self, embeds, keep):
        where = torch.nonzero(keep).squeeze(-1)
        return embeds.index_select(1, where).sum()


@pytest.mark.parametrize("backend", ["portable", "xnnpack", pytest.param("coreml", marks=slow),
                                     pytest.param("mlx", marks=slow)])
def test_nonzeros_result_squeezed_runs_right(backend):
    model = SqueezedPositions().eval()
    keep = torch.tensor([True, False, True, True, False, True])
    result = compiler.compile(model, (torch.randn(1, 6, 8), keep), backend, cache=False)
    for keep in (keep, torch.zeros(6, dtype=torch.bool), torch.ones(6, dtype=torch.bool)):
        inputs = (torch.randn(1, 6, 8), keep)
        check = compiler.compare_with_eager(result, model, inputs)
        assert check.passed, (keep, check.describe())


class PositionsOf2DMask(torch.nn.Module):
    """`nonzero` of a 2-D mask read three ways: by column, as floats, made contiguous. torch lays
    the (count, 2) result out by column; the runtime writes it by row. Stock's dim order from
    torch's strides: `.contiguous()` read it transposed (off by 10, silently), `.float()` failed in
    to_edge ("Failed to map a given dim_order: [1, 0]"). And MLX's take refuses an empty array: a
    column of an all-False mask's positions threw there."""

    def forward(self, mask):
        positions = torch.nonzero(mask)
        return positions[:, 1] * 10 + positions[:, 0], positions.float() * 1.5, positions.contiguous() + 1


@pytest.mark.parametrize("backend", ["portable", "mlx", pytest.param("xnnpack", marks=slow),
                                     pytest.param("coreml", marks=slow)])
def test_nonzero_of_a_2d_mask_runs_right_read_any_way(backend):
    model = PositionsOf2DMask().eval()
    mask = torch.tensor([[True, False, True], [False, True, True]])
    result = compiler.compile(model, (mask,), backend, cache=False)
    for mask in (mask, torch.zeros(2, 3, dtype=torch.bool), torch.ones(2, 3, dtype=torch.bool)):
        check = compiler.compare_with_eager(result, model, (mask,))
        assert check.passed, (mask, check.describe())


class ImageTokensAndPickedText(torch.nn.Module):
    """A VLM prefix: image tokens at constant positions (the fold makes the mask positions, then
    propagates shapes again) beside a data-dependent selection."""

    def __init__(self):
        super().__init__()
        self.register_buffer("is_image", torch.tensor([False, True, True, False, True, False]))

    def forward(self, embeds, keep):
        image = embeds[:, self.is_image]
        where = torch.nonzero(keep).squeeze(-1)
        return image.sum() + embeds.index_select(1, where).sum()


def test_after_the_fold_every_data_dependent_op_is_bound_to_the_symbols_its_value_holds():
    """Fake propagation left `unbacked_bindings` naming fresh symbols no value held (u2 for a value
    of size u0): a later trace that rebinds by them stops ("Pending unbacked symbols ... not in
    returned outputs")."""
    inputs = (torch.randn(1, 6, 8), torch.tensor([True, False, True, True, False, True]))
    result = compiler.compile(ImageTokensAndPickedText(), inputs, "xnnpack", stop_after="fold", cache=False)
    assert result.stages.fold.program is not result.stages.capture.program  # the fold rewrote the mask
    bound = 0
    for node in result.stages.fold.program.graph.nodes:
        for symbol, path in (node.meta.get("unbacked_bindings") or {}).items():
            held = {s for d in node.meta["val"].shape if isinstance(d, torch.SymInt) for s in d.node.expr.free_symbols}
            assert symbol in held, (node.name, symbol, node.meta["val"].shape)
            bound += 1
    assert bound >= 1
    check = compiler.compare_with_eager(compiler.compile(ImageTokensAndPickedText(), inputs, "xnnpack", cache=False),
                                        ImageTokensAndPickedText(), inputs)
    assert check.passed, check.describe()
