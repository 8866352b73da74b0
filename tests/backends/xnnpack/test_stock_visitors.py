"""What stock XNNPACK 1.5.1 lowers wrongly, that compiler/backends/xnnpack/rules.py keeps off it.

Found by test_xnnpack_support_table.py (each op's non-tensor arguments off their
defaults). Each case is checked against stock `to_edge_transform_and_lower` with
XnnpackPartitioner, so that a newer ExecuTorch that fixes it fails here and the rule
can go; and against our pipeline, which must give eager's numbers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import compiler


class Op(torch.nn.Module):
    def __init__(self, name: str, **weights: torch.Tensor) -> None:
        super().__init__()
        self.name = name
        for key, value in weights.items():
            setattr(self, key, torch.nn.Parameter(value, requires_grad=False))

    def forward(self, x):
        aten = torch.ops.aten
        if self.name == "addmm_beta_alpha":
            return torch.addmm(self.b, x, self.w, beta=0.5, alpha=2.0)
        if self.name == "bilinear_scale":
            return F.interpolate(x, scale_factor=2.2, mode="bilinear")
        if self.name == "hardtanh_min_only":
            return aten.hardtanh.default(x, 0.5)
        if self.name == "max_dim_last":
            return aten.max.dim(x, -1, True)[0]
        if self.name == "max_pool_unbatched":
            return F.max_pool2d(x, 2)
        if self.name == "prelu_3d":
            return F.prelu(x, self.w)
        if self.name == "patchify_7d":  # a video's patches: (batch, channels, time, h, ph, w, pw)
            return x.reshape(1, 3, 1, 4, 2, 4, 2) * 2
        raise ValueError(self.name)


def _case(name: str):
    torch.manual_seed(0)
    r = torch.randn
    return {
        "addmm_beta_alpha": (Op(name, w=r(4, 5), b=r(5)), r(3, 4)),
        "bilinear_scale": (Op(name), r(1, 2, 3, 3)),
        "hardtanh_min_only": (Op(name), r(2, 3)),
        "max_dim_last": (Op(name), r(1, 2, 3, 4)),
        "max_pool_unbatched": (Op(name), r(2, 6, 6)),
        "prelu_3d": (Op(name, w=torch.rand(3)), r(2, 3, 5)),
        "patchify_7d": (Op(name), r(1, 3, 64)),
    }[name]


# What stock does: a silent error larger than this, or this exception from inside to_backend.
STOCK = {
    "addmm_beta_alpha": 1e-2,  # op_addmm.py: bias + x @ w, beta and alpha ignored
    "bilinear_scale": 1e-2,  # op_static_resize_bilinear_2d.py: samples at in / out, not 1 / scale
    "hardtanh_min_only": "tuple index out of range",  # op_hardtanh.py reads args[2]
    "max_dim_last": "only supports dim == 2 or dim == 3",  # op_max_dim.py
    "max_pool_unbatched": "non-NHWC compatible node",  # ChannelsLastTaggedReshapePass: 4-D only
    "prelu_3d": "non-NHWC compatible node",
    "patchify_7d": "Failed to load method forward",  # XNNPACK defines tensors of at most 6 dimensions
}


def _stock(model, x):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    program = to_edge_transform_and_lower(torch.export.export(model, (x,)), partitioner=[XnnpackPartitioner()])
    (out,) = Runtime.get().load_program(program.to_executorch().buffer).load_method("forward").execute([x])
    return out


@pytest.mark.parametrize("name", sorted(STOCK))
def test_stock_is_wrong_and_we_are_right(name):
    model, x = _case(name)
    model.eval()
    with torch.no_grad():
        want = model(x)
    if isinstance(STOCK[name], str):
        with pytest.raises(Exception) as failure:
            _stock(model, x)
        chain, cause = [], failure.value
        while cause is not None:
            chain.append(str(cause))
            cause = cause.__cause__
        assert any(STOCK[name] in text for text in chain), chain
    else:
        try:
            wrong = (_stock(model, x) - want).abs().max() > STOCK[name]  # silently another number
        except RuntimeError as error:  # or, for bilinear, a resize to sizes read from garbage
            wrong = "failed with error" in str(error)
        assert wrong
    (got,) = compiler.run(compiler.compile(model, (x,), "xnnpack"), (x,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_delegate_over_xnnpacks_rank_fails_verification_naming_the_node():
    """Without the rule, the invariant after lower names the 7-D node before any .pte is written."""
    from compiler.backends.xnnpack import rules
    from compiler.ir.errors import StageFailure, VerificationError

    model, x = _case("patchify_7d")
    rules.RULES.rules, kept = [r for r in rules.RULES.rules if r.name != "too_many_dimensions"], rules.RULES.rules
    try:
        with pytest.raises((VerificationError, StageFailure), match="delegates_within_rank_limits") as failure:
            compiler.compile(model, (x,), "xnnpack", cache=False)
    finally:
        rules.RULES.rules = kept
    assert "7-D, XnnpackBackend takes 6" in str(failure.value)
