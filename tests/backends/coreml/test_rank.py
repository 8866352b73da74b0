"""Rank above 5: shape-only chains through rank 6 are rewritten at rank <= 5; the rest runs on the CPU."""

import pytest
import torch
import torch.nn as nn
from executorch.exir import to_edge

from compiler.backends.coreml.rank import reduce_rank
from coreml_helpers import compile_coreml, cpu_ops, cpu_reasons, delegated_ops, export, models, stock_error


class PixelShuffle(nn.Module):
    """Pixel shuffle written out: reshape -> permute -> reshape through rank 6."""

    def __init__(self, returned=False):
        super().__init__()
        self.returned = returned  # the chain's result is the program's output

    def forward(self, x):
        n, c, h, w = x.shape
        y = (x + 1).reshape(n, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(n, c // 4, h * 2, w * 2)
        return y if self.returned else y * 2


class StackCameras(nn.Module):
    """A robot policy's cameras: `torch.stack` of 5-D (batch, time, C, H, W) tensors, flattened for a conv."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 1)

    def forward(self, left, right):
        frames = torch.stack([left * 2, right * 2], dim=1)  # (B, cams, T, C, H, W)
        return self.conv(frames.flatten(0, 2)).relu()


class ComputesAtRank6(nn.Module):
    """A multiply between the stack and the flatten: only that part cannot be written at rank 5."""

    def forward(self, a, b):
        frames = torch.stack([a + 1, b + 1], dim=1) * 2
        return frames.flatten(0, 2).sin()


class InterleavesSixAxes(nn.Module):
    """A permute that moves all six axes: no merging brings it to rank 5."""

    def forward(self, x):
        y = (x + 1).reshape(2, 3, 2, 3, 2, 3).permute(5, 3, 1, 4, 2, 0).reshape(27, 8)
        return y.sin()


def _cameras():
    return torch.randn(1, 2, 3, 4, 4), torch.randn(1, 2, 3, 4, 4)


def _matches_eager(artifact, model, inputs):
    """The partitioned program (rewrite included) computes what the model does."""
    program = artifact.stages["partition"].program
    with torch.no_grad():
        return torch.allclose(program.module()(*inputs), model(*inputs), atol=1e-6)


def test_stack_of_5d_tensors_flattened_stays_in_core_ml():
    model, inputs = StackCameras(), _cameras()
    assert "Core ML only supports tensors with rank <= 5" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    assert not cpu_ops(artifact)
    assert {"aten.cat.default", "aten.conv2d.default"} <= set(delegated_ops(artifact))
    assert artifact.program.delegates == ("CoreMLBackend",)
    assert _matches_eager(artifact, model.eval(), inputs)
    ranks = [
        n.meta["val"].dim() for n in artifact.stages["partition"].program.graph.nodes if "val" in n.meta
        if isinstance(n.meta["val"], torch.Tensor)
    ]
    assert max(ranks) <= 5


@pytest.mark.parametrize("returned", [False, True], ids=["used", "returned"])
def test_pixel_shuffle_chain_through_rank_6_stays_in_core_ml(returned):
    # Stock builds this one (coremltools' own pass expands the rank-6 reshape/transpose);
    # before the rewrite, our rank rule sent the chain to the CPU.
    model, inputs = PixelShuffle(returned), (torch.randn(1, 8, 3, 3),)
    artifact = compile_coreml(model, inputs)
    assert not cpu_ops(artifact)
    assert "aten.permute_copy.default" in delegated_ops(artifact)
    assert _matches_eager(artifact, model, inputs)
    (mil,) = models(artifact)
    assert "transpose" in mil.op_types()


def test_only_the_part_computing_at_rank_6_runs_on_cpu():
    model, inputs = ComputesAtRank6(), _cameras()
    assert "Core ML only supports tensors with rank <= 5" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    assert sorted(cpu_ops(artifact).values()) == [
        "aten.mul.Tensor",
        "aten.view_copy.default",  # the stack's view to rank 6
        "aten.view_copy.default",  # the flatten back to rank 4
    ]
    assert all("rank 6" in r for r in cpu_reasons(artifact).values())
    # The ops before (add, the stack's cat) and after (sin) the rank-6 part are delegated.
    assert {"aten.add.Tensor", "aten.cat.default", "aten.sin.default"} <= set(delegated_ops(artifact))
    assert artifact.program.delegates == ("CoreMLBackend", "CoreMLBackend")
    assert _matches_eager(artifact, model, inputs)


def test_chain_that_needs_six_axes_runs_on_cpu():
    model, inputs = InterleavesSixAxes(), (torch.randn(216),)
    artifact = compile_coreml(model, inputs)
    assert sorted(set(cpu_ops(artifact).values())) == [
        "aten.permute_copy.default",
        "aten.view_copy.default",
        "dim_order_ops._clone_dim_order.default",  # the reshape's copy of the permuted tensor
    ]
    assert all("rank 6" in r for r in cpu_reasons(artifact).values())
    assert {"aten.add.Tensor", "aten.sin.default"} <= set(delegated_ops(artifact))


def test_rewritten_program_runs_on_the_portable_runtime():
    from executorch.runtime import Runtime

    model, inputs = StackCameras().eval(), _cameras()
    edge = to_edge(export(model, inputs))
    assert reduce_rank(edge.exported_program())
    pte = edge.to_executorch().buffer
    method = Runtime.get().load_program(pte).load_method("forward")
    (out,) = method.execute(list(inputs))
    with torch.no_grad():
        assert torch.allclose(out, model(*inputs), atol=1e-5)


def _random_steps(rng, shape):
    steps, numel = [], 1
    for size in shape:
        numel *= size
    rank = len(shape)
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.5:
            order = list(range(rank))
            rng.shuffle(order)
            steps.append(("permute", order))
        else:
            dims, left = [], numel
            while left > 1 and len(dims) < 6:
                size = rng.choice([k for k in range(2, left + 1) if left % k == 0])
                dims.append(size)
                left //= size
            dims += [1] * rng.randint(0, 1)
            rng.shuffle(dims)
            steps.append(("reshape", dims))
            rank = len(dims)
    return steps


def test_reshape_permute_of_a_chain_matches_torch():
    import random

    from compiler.backends.coreml.rank import as_reshape_permute

    rng, found = random.Random(0), 0
    for _ in range(300):
        shape = [rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(1, 5))]
        x = torch.arange(torch.Size(shape).numel()).reshape(shape)
        steps, expected = _random_steps(rng, shape), x
        for kind, arg in steps:
            expected = expected.permute(arg) if kind == "permute" else expected.reshape(arg)
        result = as_reshape_permute(shape, steps)
        if result is not None:
            found += 1
            reshape, order = result
            assert torch.equal(x.reshape(reshape).permute(order).reshape(expected.shape), expected), steps
    assert found > 200
