"""The decompose stage: one decomposition, kept-whole ops, a pure Edge program."""

import pytest
import torch
from torch._export.verifier import SpecViolationError

import compiler
from compiler.backends.base import Backend, BackendPartition, KeepWhole
from compiler.ir.dialect import ATEN, op_dialect, op_name
from compiler.ir.errors import UnsupportedOp
from compiler.stages.base import StageContext
from compiler.stages.decompose import Decompose
from executorch.exir import to_edge


class MaskedAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x, mask):
        return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]


def inputs():
    return torch.randn(1, 4, 16), torch.tensor([[False, True, False, False]] * 4)


def test_stock_to_edge_leaves_an_aten_op_in_the_edge_program():
    with torch.no_grad():
        ep = torch.export.export(MaskedAttention().eval(), inputs())
    edge = to_edge(ep).exported_program()
    left = [op_name(n.target) for n in edge.graph.nodes if n.op == "call_function" and op_dialect(n.target) == ATEN]
    assert left == ["aten.scalar_tensor.default"]


def test_masked_attention_becomes_a_pure_edge_program_and_matches_eager():
    model, args = MaskedAttention().eval(), inputs()
    artifact = compiler.compile(model, args, "portable")
    edge = artifact.stages["decompose"].program
    assert not [n for n in edge.graph.nodes if n.op == "call_function" and op_dialect(n.target) == ATEN]
    assert compiler.compare_with_eager(artifact, model, args).max_abs_error < 1e-5


class KeepLinear(Backend):
    name = "keep-linear"

    def keep_whole(self, program):
        return KeepWhole(frozenset({torch.ops.aten.linear.default}), lambda node: node.name == "linear")

    def partition(self, program):
        return BackendPartition({})


def test_node_filter_keeps_only_accepted_nodes_whole_and_leaves_the_input_unchanged():
    class TwoLinears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    planned = compiler.compile(TwoLinears(), (torch.randn(2, 4),), KeepLinear(), stop_after="dry_run").artifact
    assert planned.keep_whole.nodes == {"linear"}
    before = [n.target for n in planned.program.graph.nodes]
    edge = Decompose().apply(planned, StageContext(KeepLinear()))
    ops = [op_name(n.target) for n in edge.program.graph.nodes if n.op == "call_function"]
    assert ops.count("aten.linear.default") == 1  # only the node the filter accepted
    assert "aten.addmm.default" in ops  # the other one decomposed
    assert [n.target for n in planned.program.graph.nodes] == before
    assert edge.preserved_ops == ("aten.linear.default",)


class PatchPositions(torch.nn.Module):
    """SigLIP / Idefics3 vision embeddings: patch coordinates bucketed into position ids."""

    def forward(self, coords):
        return torch.bucketize(coords, torch.tensor([0.25, 0.5, 0.75]), right=True) * 4


def test_stock_to_edge_refuses_bucketize_which_no_table_of_executorch_decomposes():
    with torch.no_grad():
        ep = torch.export.export(PatchPositions(), (torch.rand(1, 4),))
    with pytest.raises(SpecViolationError, match="bucketize.Tensor is not in Core ATen opset"):
        to_edge(ep)


def test_bucketize_is_decomposed_with_torchs_table_and_matches_eager():
    model, args = PatchPositions(), (torch.tensor([[0.0, 0.25, 0.6, 0.99]]),)
    artifact = compiler.compile(model, args, "portable")
    ops = {op_name(n.target) for n in artifact.stages["decompose"].program.graph.nodes if n.op == "call_function"}
    assert not any("bucketize" in op for op in ops)
    assert torch.equal(compiler.run(artifact, args)[0], model(*args))


class RotateHalves(torch.nn.Module):
    """SmolVLA's expert rotary embedding: `torch.empty_like(x)` filled by slices."""

    def __init__(self, transposed=False):
        super().__init__()
        self.transposed = transposed

    def forward(self, x):
        x = x.transpose(1, 2) if self.transposed else x  # empty_like keeps a transposed layout
        rotated = torch.empty_like(x)
        rotated[..., 0::2] = -x[..., 1::2]
        rotated[..., 1::2] = x[..., 0::2]
        return rotated


def test_stock_to_edge_refuses_the_empty_permuted_its_own_empty_like_decomposition_makes():
    with torch.no_grad():
        ep = torch.export.export(RotateHalves(), (torch.randn(2, 4),))
    with pytest.raises(SpecViolationError, match="empty_permuted.default is not in Core ATen opset"):
        to_edge(ep)


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_empty_like_filled_by_slices_matches_eager(transposed):
    model, args = RotateHalves(transposed), (torch.randn(2, 4, 4),)
    artifact = compiler.compile(model, args, "portable")
    ops = {op_name(n.target) for n in artifact.stages["decompose"].program.graph.nodes if n.op == "call_function"}
    assert "aten.empty_permuted.default" not in ops
    assert torch.equal(compiler.run(artifact, args)[0], model(*args))


class Median(torch.nn.Module):
    def forward(self, x):
        return torch.median(x)


class MedianOfLastDim(torch.nn.Module):
    def forward(self, x):
        values, indices = x.median(dim=-1)
        return values, indices


class MedianKeepDim(torch.nn.Module):
    def forward(self, x):
        values, indices = x.median(dim=0, keepdim=True)
        return values, indices


def test_stock_to_edge_refuses_median_which_neither_table_decomposes():
    from torch._decomp import decomposition_table
    from executorch.extension.pybindings.portable_lib import _get_operator_names

    assert torch.ops.aten.median.dim not in decomposition_table
    assert not any("median" in name for name in _get_operator_names())  # no kernel to keep it for
    with torch.no_grad():
        ep = torch.export.export(MedianOfLastDim(), (torch.randn(3, 5),))
    with pytest.raises(SpecViolationError, match="median.dim is not in Core ATen opset"):
        to_edge(ep)


_NAN = float("nan")
MEDIAN_INPUTS = {
    "odd": torch.randn(3, 5),
    "even": torch.randn(4, 6),  # torch's median is the lower middle value
    "nan": torch.tensor([[3.0, _NAN, 1.0, _NAN, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0]]),  # NaN at the first NaN
    "int": torch.randperm(15).reshape(3, 5),
}


@pytest.mark.parametrize("model_type", [Median, MedianOfLastDim, MedianKeepDim])
@pytest.mark.parametrize("case", MEDIAN_INPUTS)
def test_median_decomposes_to_topk_and_matches_eager(model_type, case):
    model, args = model_type(), (MEDIAN_INPUTS[case],)
    artifact = compiler.compile(model, args, "portable")
    ops = {op_name(n.target) for n in artifact.stages["decompose"].program.graph.nodes if n.op == "call_function"}
    assert not any("median" in op for op in ops) and "aten.topk.default" in ops
    expected = model(*args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for got, want in zip(compiler.run(artifact, args), expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want) or torch.allclose(got, want, equal_nan=True)


class MixedCat(torch.nn.Module):
    def forward(self, mask, x):
        return torch.cat([mask, x * 2], -1) + 1, torch.stack([mask, mask.to(torch.uint8)])


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "mlx", "coreml"])
def test_a_cat_of_mixed_dtypes_gets_explicit_casts(backend):
    inputs = (torch.rand(2, 3) > 0.5, torch.randn(2, 4, dtype=torch.float16))
    with pytest.raises(Exception, match="mismatched dtypes"):
        to_edge(torch.export.export(MixedCat(), inputs))  # stock
    artifact = compiler.compile(MixedCat(), inputs, backend)
    if backend != "coreml":
        for got, want in zip(compiler.run(artifact, inputs), MixedCat()(*inputs), strict=True):
            torch.testing.assert_close(got, want)


class Remainders(torch.nn.Module):
    def forward(self, t, d):
        return torch.remainder(t, 5), t % d, torch.remainder(t.float(), 5)


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "mlx"])
def test_integer_remainder_floors_like_torch(backend):
    t, d = torch.tensor([-2, 3, -7, 12], dtype=torch.int32), torch.tensor([5, -3, 3, 5], dtype=torch.int32)
    artifact = compiler.compile(Remainders(), (t, d), backend)
    for got, want in zip(compiler.run(artifact, (t, d)), Remainders()(t, d), strict=True):
        assert torch.equal(got, want)


class ScalarRemainder(torch.nn.Module):
    """A 0-d int8 tensor's remainder by a Python int is int8 in torch; traced, the int is a 0-d
    int64 tensor, and two 0-d tensors promote to int64 (found by the fuzzer at model sizes)."""

    def forward(self, t):
        return t.unbind(0)[1] % -3


@pytest.mark.parametrize("backend", ["portable", "mlx"])
def test_a_scalar_remainder_keeps_torchs_dtype(backend):
    t = torch.tensor([-7, 5, 3], dtype=torch.int8)
    (got,) = compiler.run(compiler.compile(ScalarRemainder(), (t,), backend), (t,))
    want = ScalarRemainder()(t)
    assert got.dtype == want.dtype == torch.int8 and torch.equal(got, want)


class MergedHeads(torch.nn.Module):
    """Heads split from the hidden dim and merged back by a `view`: eager CPU attention of
    transposed inputs returns heads-minor strides, so the transposed result is contiguous."""

    def forward(self, x):
        b, s, e = x.shape
        q = x.view(b, s, 4, e // 4).transpose(1, 2)
        attention = torch.nn.functional.scaled_dot_product_attention(q, q * 0.5, q)
        return attention.transpose(1, 2).view(b, s, e) * 2


@pytest.mark.parametrize("backend", ["mlx", "coreml"])
def test_a_view_after_attention_kept_whole_matches_eager(backend):
    """Kept whole, attention's meta kernel gives contiguous heads-major strides, on which the
    `view` after the transpose failed ("Cannot view a tensor with shape [2, 8, 4, 16] and strides
    (512, 16, 128, 1)"); it is decomposed as the reshape it needs."""
    model, args = MergedHeads().eval(), (torch.randn(2, 8, 64),)
    artifact = compiler.compile(model, args, backend)
    assert "aten.scaled_dot_product_attention.default" in artifact.stages["decompose"].preserved_ops
    torch.testing.assert_close(compiler.run(artifact, args)[0], model(*args), atol=2e-3, rtol=2e-3)


class LongHalfRows(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.layer_norm(x, (x.shape[-1],)), x.var(-1), x.cumsum(-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["portable", pytest.param("xnnpack", marks=pytest.mark.slow)])
def test_half_precision_rows_of_a_models_width_accumulate_in_float32_like_torch(backend, dtype):
    """The portable kernels accumulated layer_norm, var and cumsum in the input's precision: a
    float16 layer norm over 2048 values came out 0.96 of its largest output off."""
    torch.manual_seed(0)
    x = torch.randn(2, 2048).to(dtype)
    got = compiler.run(compiler.compile(LongHalfRows(), (x,), backend), (x,))
    for g, w in zip(got, LongHalfRows()(x), strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("backend", ["coreml", pytest.param("mlx", marks=pytest.mark.slow),
                                     pytest.param("portable", marks=pytest.mark.slow)])
def test_a_float16_layer_norm_with_weights_converts_and_matches_eager(backend):
    """Normalized in float32 and its weights applied in float16: a weight cast in the graph is not a
    constant, which Core ML's layer_norm refuses ("Input gamma must be const at compile time")."""
    torch.manual_seed(0)
    model, x = torch.nn.LayerNorm(2048).half().eval(), torch.randn(2, 8, 2048).half()
    check = compiler.compare_with_eager(compiler.compile(model, (x,), backend), model, (x,))
    assert check.passed, check.describe()


class KthValue(torch.nn.Module):
    def forward(self, x):
        return torch.kthvalue(x, 2, -1)[0]


def test_an_op_with_no_decomposition_nor_kernel_is_refused_by_name_with_what_to_do():
    """kthvalue is not core ATen, no table decomposes it and the runtime has no kernel for it:
    the Edge verifier's refusal was reported as 'a bug in the stage that produced the program'."""
    with pytest.raises(UnsupportedOp) as caught:
        compiler.compile(KthValue(), (torch.randn(3, 5),), "portable")
    error = caught.value
    assert error.stage == "decompose" and error.nodes == ("aten_kthvalue_default",)
    assert error.reason.startswith("aten.kthvalue.default (aten_kthvalue_default) has no decomposition to core ATen "
                                   "and no kernel in the portable runtime")
    assert "core ATen" in error.hint and "bug" not in str(error)


class DiagonalScatter(torch.nn.Module):
    def __init__(self, offset, dim1, dim2):
        super().__init__()
        self.offset, self.dim1, self.dim2 = offset, dim1, dim2

    def forward(self, x, src):
        return torch.diagonal_scatter(x, src, self.offset, self.dim1, self.dim2)


@pytest.mark.parametrize("offset, dim1, dim2", [(0, 0, 1), (-2, 0, 1), (3, -1, 0), (1, 2, 0)])
def test_diagonal_scatter_decomposes_to_a_scatter_and_matches_eager(offset, dim1, dim2):
    """torch's decomposition wrote the diagonal view with prims.copy_to, which the retrace
    refused: 'aot_autograd expected to have an entirely functional graph' (OpInfo's samples)."""
    x = torch.randn(3, 5, 4)
    src = torch.randn(torch.diagonal(x, offset, dim1, dim2).shape)
    model = DiagonalScatter(offset, dim1, dim2)
    artifact = compiler.compile(model, (x, src), "portable")
    ops = {op_name(n.target) for n in artifact.stages["decompose"].program.graph.nodes if n.op == "call_function"}
    assert "aten.diagonal_scatter.default" not in ops and "aten.scatter.src" in ops
    assert torch.equal(compiler.run(artifact, (x, src))[0], model(x, src))


class MaxOfAll(torch.nn.Module):
    def forward(self, x):
        return torch.max(x), torch.min(x)


def test_an_op_the_edge_verifier_takes_although_not_core_aten_is_not_refused():
    """aten.max.default (the max of every element) is not core ATen, but ExecuTorch's Edge
    verifier takes it (its list of exceptions) and the runtime has its kernel: it compiles."""
    model, inputs = MaxOfAll(), (torch.randn(3, 5),)
    artifact = compiler.compile(model, inputs, "portable")
    ops = {op_name(n.target) for n in artifact.stages["decompose"].program.graph.nodes if n.op == "call_function"}
    assert {"aten.max.default", "aten.min.default"} <= ops
    assert all(torch.equal(got, want) for got, want in zip(compiler.run(artifact, inputs), model(*inputs), strict=True))
