"""Node rules: bool min/max, index_put forms, rank above 5."""

import pytest
import torch
import torch.nn as nn

from coreml_helpers import compile_coreml, cpu_ops, cpu_reasons, delegated_ops, stock_error


class BoolReduce(nn.Module):
    def __init__(self, reduce):
        super().__init__()
        self.reduce = reduce

    def forward(self, x):
        return self.reduce(x > 0).float() + x.sum(-1)


@pytest.mark.parametrize(
    "reduce, op",
    [
        (lambda b: b.amax(dim=-1), "aten.amax.default"),
        (lambda b: b.amin(dim=-1), "aten.amin.default"),
        (lambda b: torch.maximum(b, b.flip(-1)).sum(-1), "aten.maximum.default"),
    ],
)
def test_min_max_over_bool_runs_on_cpu(reduce, op):
    model, inputs = BoolReduce(reduce), (torch.randn(2, 4),)
    artifact = compile_coreml(model, inputs)
    assert op in cpu_ops(artifact).values()
    assert "gt" in " ".join(delegated_ops(artifact))
    reason = next(r for n, r in cpu_reasons(artifact).items() if cpu_ops(artifact)[n] == op)
    assert "over bool" in reason


def test_stock_fails_on_bool_amax():
    assert "reduce_max" in stock_error(BoolReduce(lambda b: b.amax(dim=-1)), (torch.randn(2, 4),))


class IndexPut(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.write = write

    def forward(self, y, v):
        y = y.clone()
        self.write(y, v)
        return y * 2


def _set_two_columns(y, v):
    y[:, torch.tensor([0, 2])] = v


def test_index_of_several_entries_next_to_slice_runs_on_cpu():
    model = IndexPut(_set_two_columns)
    inputs = (torch.randn(2, 4, 3), torch.randn(2, 2, 3))
    assert "Input squeeze_0 has rank 1 != other inputs rank 0" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    assert "aten.index_put.default" in cpu_ops(artifact).values()
    assert "aten.mul.Tensor" in delegated_ops(artifact)
    reason = [r for r in cpu_reasons(artifact).values() if "index_put" in r][0]
    assert "an index of more than one entry next to a slice" in reason


class CacheUpdate(nn.Module):
    """The single-entry cache-update form, which Core ML converts."""

    def forward(self, cache, pos, v):
        cache = cache.clone()
        cache[:, :, pos] = v
        return cache * 2


class Accumulate(nn.Module):
    def forward(self, y, idx, v):
        return torch.index_put(y, (idx,), v, accumulate=True) * 2


class BoolMask(nn.Module):
    def forward(self, y, v):
        y = y.clone()
        y[y > 0] = v
        return y * 2


@pytest.mark.parametrize(
    "model, inputs, on_cpu, why",
    [
        (CacheUpdate(), (torch.randn(1, 2, 6, 4), torch.tensor([3]), torch.randn(1, 2, 1, 4)), False, None),
        (Accumulate(), (torch.randn(5, 3), torch.tensor([0, 0, 2]), torch.randn(3, 3)), True, "accumulate=True"),
        (BoolMask(), (torch.randn(4, 3), torch.tensor(1.0)), True, "a bool mask index"),
    ],
    ids=["cache-update", "accumulate", "bool-mask"],
)
def test_index_put_forms(model, inputs, on_cpu, why):
    artifact = compile_coreml(model, inputs)
    cpu = cpu_ops(artifact)
    index_put = [op for op in cpu.values() if op.startswith("aten.index_put")]
    assert bool(index_put) == on_cpu
    if why:
        assert any(why in r for r in cpu_reasons(artifact).values())
    else:
        assert "aten.index_put.default" in delegated_ops(artifact)


class Stack5d(nn.Module):
    def forward(self, x):
        return torch.stack([x, x + 1], dim=1) * 2


def test_rank_above_five_runs_on_cpu():
    model, inputs = Stack5d(), (torch.randn(1, 2, 2, 2, 2),)
    assert "Core ML only supports tensors with rank <= 5" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    reasons = cpu_reasons(artifact)
    assert reasons and all("rank 6" in r for r in reasons.values())
    assert "aten.add.Tensor" in delegated_ops(artifact)
