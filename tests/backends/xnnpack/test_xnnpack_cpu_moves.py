"""CPU ops between delegated ones moved into XNNPACK by exact rewrites (compiler/backends/xnnpack/moves.py),
and the constants SDPA's decomposition computes folded before the search: each op sits between
two Linears, so on the CPU it would cut the delegate in two. The program still matches eager."""

import pytest
import torch
from torch import nn

import compiler
from compiler.models.examples import Transformer


class Between(nn.Module):
    """`op` between two Linears of 16 features."""

    def __init__(self, op, features: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.op, self.first, self.second = op, nn.Linear(features, features), nn.Linear(features, features)

    def forward(self, x):
        return self.second(self.op(self.first(x)))


def _repeat_kv(y):
    """Grouped-query attention's repeat_kv: (b, kv, s, d) -> (b, kv * 2, s, d)."""
    b, kv, s, d = y.shape
    return y[:, :, None, :, :].expand(b, kv, 2, s, d).reshape(b, kv * 2, s, d)


def _halves_written(y):
    """Both halves of the last dim written in place, as SmolVLM's rotary embedding does."""
    out = y.clone()
    out[..., :8] = y[..., 8:] * 2
    out[..., 8:] = y[..., :8] - 1
    return out


def _rms_norm(y):
    return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)


OPS = {
    "mul_scalar": lambda y: torch.ops.aten.mul.Scalar(y, 0.3),
    "cube": lambda y: 0.044715 * torch.pow(y, 3.0) + y,
    "square_of_float_exponent": lambda y: y ** 2.0,
    "expand_same_shape": lambda y: y.expand(2, 4, 3, 16),
    "expand_into_add": lambda y: y + y[:, :, :1, :].expand(2, 4, 3, 16),
    "expand_repeat_kv": _repeat_kv,
    "split": lambda y: torch.cat([t * 2 for t in y.split([5, 11], dim=-1)], -1),
    "rms_norm_mean": _rms_norm,
    "mean_of_two_trailing_dims": lambda y: y - y.mean((-2, -1), keepdim=False)[..., None, None],
    "squeeze_unsqueeze_select": lambda y: y[:, 1:2].squeeze(1).unsqueeze(0).select(0, 0)[:, None].expand(2, 4, 3, 16),
    "slice_assignment": _halves_written,
    "cat_of_one": lambda y: torch.cat([y], 1) * 2,
    "alias_copy": lambda y: torch.ops.aten.alias_copy.default(y) * 2,
    "copy": lambda y: torch.ops.aten.copy.default(y * 2, y + 1) * 3,
}
MOVED_OPS = {
    "mul_scalar": "aten.mul.Scalar",
    "cube": "aten.pow.Tensor_Scalar",
    "square_of_float_exponent": "aten.pow.Tensor_Scalar",
    "expand_same_shape": "aten.expand_copy.default",
    "expand_into_add": "aten.expand_copy.default",
    "expand_repeat_kv": "aten.expand_copy.default",
    "split": "aten.split_with_sizes_copy.default",
    "rms_norm_mean": "aten.mean.dim",
    "mean_of_two_trailing_dims": "aten.mean.dim",
    "squeeze_unsqueeze_select": "aten.select_copy.int",
    "slice_assignment": "aten.slice_scatter.default",
    "cat_of_one": "aten.cat.default",
    "alias_copy": "aten.alias_copy.default",
    "copy": "aten.copy.default",
}


def _edge_ops(model, args) -> set[str]:
    from compiler.ir.dialect import op_name

    edge = compiler.compile(model, args, "xnnpack", stop_after="decompose").artifact.program
    return {op_name(n.target) for n in edge.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("name", list(OPS))
def test_the_op_runs_in_one_delegate_and_matches_eager(name):
    model, args = Between(OPS[name]).eval(), (torch.randn(2, 4, 3, 16),)
    assert MOVED_OPS[name] in _edge_ops(model, args)  # what the partition search is given
    result = compiler.compile(model, args, "xnnpack")
    plan = result.program.plan
    assert not plan.cpu_nodes, [(n.op, n.reason) for n in plan.cpu_nodes]
    assert len(plan.partitions) == 1
    (got,) = result.run(*args)
    with torch.no_grad():
        torch.testing.assert_close(got, model(*args), rtol=1e-5, atol=1e-5)


def test_ops_not_float32_stay_as_they_were():
    """An int expand is left to the CPU: XNNPACK takes float32 only, so no rewrite would help."""
    model = Between(lambda y: y + torch.arange(3)[:, None].expand(3, 16).to(y.dtype)).eval()
    args = (torch.randn(2, 4, 3, 16),)
    (got,) = compiler.compile(model, args, "xnnpack").run(*args)
    with torch.no_grad():
        torch.testing.assert_close(got, model(*args))


class CausalAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = (t.view(1, 8, 2, 16).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        mask = torch.arange(8)[:, None] >= torch.arange(8)  # causal, from sizes, as transformers builds it
        return self.out(nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(1, 8, 32))


def test_a_constant_attention_mask_is_folded_after_decomposition():
    """SDPA's decomposition turns the bool mask into a float one (`where(mask, 0, -inf)` of
    0-d fills): folded, only the safe softmax's row check (on the scores) is left on the CPU."""
    model, args = CausalAttention().eval(), (torch.randn(1, 8, 32),)
    result = compiler.compile(model, args, "xnnpack")
    on_cpu = {n.op for n in result.program.plan.cpu_nodes}
    assert "aten.scalar_tensor.default" not in on_cpu
    assert on_cpu == {"aten.eq.Scalar", "aten.logical_not.default", "aten.any.dim", "aten.full_like.default", "aten.where.self"}
    (got,) = result.run(*args)
    with torch.no_grad():
        torch.testing.assert_close(got, model(*args), rtol=1e-5, atol=1e-5)


def test_a_transformer_stack_is_cut_only_at_its_layer_norms_and_safe_softmaxes():
    """The attention's scale, split and expands move in: the delegate is cut only where a layer
    norm or a safe softmax (a row of -inf gives 0, not NaN) runs on the CPU."""
    torch.manual_seed(0)
    model, args = Transformer(2, 32, 2).eval(), (torch.randn(1, 8, 32),)
    result = compiler.compile(model, args, "xnnpack")
    plan = result.program.plan
    assert {n.op for n in plan.cpu_nodes} == {
        "aten.native_layer_norm.default",
        "aten.eq.Scalar", "aten.logical_not.default", "aten.any.dim", "aten.full_like.default", "aten.where.self",
    }
    assert len(plan.partitions) == 6  # between the CPU's 5 norms and 2 safe softmaxes; the first norm reads the input
    (got,) = result.run(*args)
    with torch.no_grad():
        torch.testing.assert_close(got, model(*args), rtol=1e-5, atol=1e-5)
