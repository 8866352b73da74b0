"""The fold stage: dialect-aware folding, skip sets, constant bool masks.

Each behaviour is checked against stock ExecuTorch 1.5.1's constant_prop_pass,
which gets it wrong on ATen programs.
"""

import copy
import io
import logging

import pytest
import torch
from torch._export.verifier import SpecViolationError

import compiler
from compiler.ir.artifacts import AtenProgram
from compiler.ir.dialect import op_name
from compiler.stages.options import FoldOptions
from compiler.stages.base import StageContext
from compiler.passes.folding import fold_constants
from compiler.stages.fold import Fold
from executorch.exir import EdgeCompileConfig, to_edge, to_edge_transform_and_lower
from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.passes.constant_prop_pass import constant_prop_pass


def export(module, inputs):
    with torch.no_grad():
        return torch.export.export(module, inputs)


def fold(ep, **options):
    ctx = StageContext(backend=None, options=FoldOptions(**options))
    return Fold().apply(AtenProgram(ep), ctx).program, ctx.metrics


def ops_of(ep):
    return [op_name(n.target) for n in ep.graph.nodes if n.op == "call_function"]


class ConstantOutput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x + 1, self.w.t() * 2  # the second output is constant


def test_stock_puts_an_edge_clone_into_an_aten_program():
    ep = constant_prop_pass(export(ConstantOutput(), (torch.randn(4, 4),)))
    with pytest.raises(SpecViolationError, match="is not an allowed operator type"):
        ep._validate()


def test_folded_output_gets_an_aten_clone_on_an_aten_program(tmp_path):
    model, inputs = ConstantOutput(), (torch.randn(4, 4),)
    folded, metrics = fold(export(model, inputs))
    assert "aten.clone.default" in ops_of(folded)
    assert "aten.t.default" not in ops_of(folded) and "aten.mul.Tensor" not in ops_of(folded)
    folded._validate()
    torch.export.save(folded, tmp_path / "folded.pt2")
    assert metrics["folded"] == 2 and metrics["constants"] == 1
    for out, want in zip(folded.module()(*inputs), model(*inputs), strict=True):
        torch.testing.assert_close(out, want)


def test_folded_output_gets_the_dim_order_clone_on_an_edge_program():
    ep = to_edge(export(ConstantOutput(), (torch.randn(4, 4),))).exported_program()
    fold_constants(ep, "edge")
    clones = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert exir_ops.edge.dim_order_ops._clone_dim_order.default in clones
    ep._validate()


class AddFull(torch.nn.Module):
    def forward(self, x):
        return x + torch.full((256, 256), 3.0)


def test_stock_folds_full_into_a_large_constant():
    ep = constant_prop_pass(export(AddFull(), (torch.randn(256, 256),)))
    assert sum(t.numel() * t.element_size() for t in ep.constants.values()) >= 256 * 256 * 4


def test_full_stays_an_op_on_an_aten_program():
    folded, metrics = fold(export(AddFull(), (torch.randn(256, 256),)))
    assert "aten.full.default" in ops_of(folded)
    assert not folded.constants and metrics["folded"] == 0


def test_user_skip_ops_add_to_the_defaults_and_can_replace_them():
    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 3))

        def forward(self, x):
            return x @ self.w.t() + torch.full((3,), 1.0)

    ep = export(Both(), (torch.randn(3, 3),))
    added, _ = fold(ep, skip_ops=["aten.t.default"])
    assert {"aten.t.default", "aten.full.default"} <= set(ops_of(added))
    replaced, _ = fold(ep, skip_ops=[torch.ops.aten.t.default], replace_skip_ops=True)
    assert "aten.t.default" in ops_of(replaced) and "aten.full.default" not in ops_of(replaced)
    with pytest.raises(compiler.UserInputError, match="names no operator"):
        fold(ep, skip_ops=["aten.no_such_op.default"])


def test_dequantize_of_a_quantized_weight_is_not_folded():
    class Quantized(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("qweight", torch.randint(-128, 127, (8, 8), dtype=torch.int8))

        def forward(self, x):
            w = torch.ops.quantized_decomposed.dequantize_per_tensor(self.qweight, 0.05, 0, -128, 127, torch.int8)
            return x @ w

    folded, _ = fold(export(Quantized(), (torch.randn(2, 8),)))
    assert "quantized_decomposed.dequantize_per_tensor.default" in ops_of(folded)
    assert all(t.dtype == torch.int8 for t in folded.state_dict.values())


def test_mutable_buffer_is_never_folded():
    class Accumulate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(4))

        def forward(self, x):
            self.total.add_(x)
            return self.total * 3  # reads the state after the update: not a constant

    ep = export(Accumulate(), (torch.randn(4),))
    folded, metrics = fold(ep)
    assert metrics["folded"] == 0
    assert "total" in folded.state_dict and "aten.mul.Tensor" in ops_of(folded)
    functional = ep.run_decompositions({})  # the same program after functionalization
    assert "total" in functional.graph_signature.buffers_to_mutate.values()
    folded, metrics = fold(functional)
    assert metrics["folded"] == 0 and "aten.mul.Tensor" in ops_of(folded)


def test_zero_stride_result_is_stored_contiguous():
    class Expand(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.v = torch.nn.Parameter(torch.randn(1, 4))

        def forward(self, x):
            return x + self.v.expand(4, 4) * 1.0

    folded, _ = fold(export(Expand(), (torch.randn(4, 4),)))
    assert folded.constants and all(t.is_contiguous() and 0 not in t.stride() for t in folded.constants.values())


def test_control_flow_is_skipped_and_said_at_info(caplog):
    """A handled limit: said in our log at INFO (-v), not as a WARNING on every generate run."""
    class Branch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3))

        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda a: a + self.w, lambda a: a - self.w, (x,)) + self.w * 2

    ep = export(Branch(), (torch.randn(3),))
    with caplog.at_level(logging.INFO, logger="compiler.passes.folding"):
        folded, metrics = fold(ep)
    said = [r for r in caplog.records if "control flow" in r.getMessage()]
    assert said and all(r.levelno == logging.INFO for r in said)
    assert metrics["folded"] == 1  # self.w * 2, outside the branch
    folded._validate()


class Masks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.tensor([True, False, True, True, False, True]))
        self.register_buffer("mask2d", torch.rand(3, 6, generator=torch.Generator().manual_seed(0)) > 0.5)
        self.register_buffer("scores", torch.randn(6, generator=torch.Generator().manual_seed(1)))

    def forward(self, x):
        folded_mask = self.scores > 0  # a mask the fold stage itself computes
        return x[:, self.mask] * 2, x[self.mask2d] + 1, x[:, folded_mask]


def test_stock_cannot_emit_a_constant_bool_mask_index():
    ep = export(Masks(), (torch.randn(3, 6),))
    with pytest.raises(Exception, match="GuardOnDataDependentSymNode|data-dependent"):
        to_edge_transform_and_lower(ep).to_executorch()


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_constant_bool_masks_become_positions_and_match_eager(backend):
    model, inputs = Masks(), (torch.randn(3, 6),)
    artifact = compiler.compile(model, inputs, backend)
    folded = artifact.stages["fold"].program
    index_nodes = [n for n in folded.graph.nodes if n.target == torch.ops.aten.index.Tensor]
    assert len(index_nodes) == 3
    shapes = [tuple(node.meta["val"].shape) for node in index_nodes]
    assert all(type(size) is int for shape in shapes for size in shape), shapes  # static, not data-dependent
    assert shapes == [tuple(out.shape) for out in model(*inputs)]  # each index selects what eager's mask does
    for node in index_nodes:
        (position,) = [i for i in node.args[1] if i is not None]
        assert position.meta["val"].dtype == torch.int64
    # the 2-D mask indexes once with flat positions, not once per dimension
    flat = [n for n in index_nodes if len(n.args[1]) == 1][0]
    assert flat.args[0].target == torch.ops.aten.reshape.default
    assert artifact.report.stage("fold").metrics["masks"] == 3
    check = compiler.compare_with_eager(artifact, model, inputs)
    assert check.max_abs_error < 1e-5


def test_fold_numbers_are_in_the_stage_table():
    artifact = compiler.compile(ConstantOutput(), (torch.randn(4, 4),), "portable")
    table = artifact.report.format_stages()
    fold_row = next(line for line in table.splitlines() if line.startswith("fold"))
    assert "folded 2 nodes into constants" in fold_row and "made 1 constant" in fold_row
    assert "added 64 bytes of constants" in fold_row


def test_nothing_to_fold_returns_the_input_unchanged():
    model = torch.nn.Linear(4, 4)
    program = AtenProgram(export(model, (torch.randn(2, 4),)))
    assert Fold().apply(program, StageContext(backend=None, options=FoldOptions())) is program


class SlicedWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        return x @ self.p[2:10]  # folds to a view 16 rows into p's storage


class TransposedSlice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        return x @ self.w.t()[2:10]


class TransposedRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 8))

    def forward(self, x):
        return x @ self.w.t()[:, 2:10].t()  # contiguous, but 16 elements into w's storage


class ViewBuffers(torch.nn.Module):
    """The model's own buffers are views into one table (as a rotary cache slice would be)."""

    def __init__(self):
        super().__init__()
        table = torch.randn(16, 8)
        self.register_buffer("low", table[:8])
        self.register_buffer("high", table[8:])

    def forward(self, x):
        return x @ self.low + x @ self.high


@pytest.mark.parametrize("backend", ["xnnpack", "portable"])
@pytest.mark.parametrize("model_type", [SlicedWeight, TransposedSlice, TransposedRows, ViewBuffers])
def test_constants_that_were_views_give_the_eager_result(model_type, backend):
    torch.manual_seed(0)
    model, x = model_type().eval(), torch.randn(4, 8)
    artifact = compiler.compile(model, (x,), backend=backend, reproducer=False)
    (out,) = compiler.run(artifact, (x,))
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def _same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _owns_its_bytes(tensor):
    return (
        tensor.storage_offset() == 0
        and tensor.is_contiguous()
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def test_folded_constants_own_their_bytes():
    for model_type in (SlicedWeight, TransposedRows):
        model = model_type()
        folded, _ = fold(export(model, (torch.randn(4, 8),)))
        (constant,) = folded.constants.values()
        assert _owns_its_bytes(constant)
        assert not _same_storage(constant, next(iter(model.parameters())))


class Alias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ self.p + x @ self.p.view(8, 8)  # the folded view is all of p's storage


def test_a_folded_alias_of_a_parameter_gets_its_own_storage():
    folded, _ = fold(export(Alias(), (torch.randn(4, 8),)))
    (constant,) = folded.constants.values()
    assert not _same_storage(constant, folded.state_dict["p"])
    torch.testing.assert_close(constant, folded.state_dict["p"])


class WrittenAfterFolding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))
        self.register_buffer("table", torch.randn(4, 4))

    def forward(self, x):
        y = self.w * 2  # foldable, but then written through a view
        y[0] = x[0]
        z = self.table.clone()  # foldable, but then written by index_put_
        z.index_put_((torch.tensor([1]),), x[1:2])
        rows = (self.table * 5).unbind(0)  # written through an item of unbind
        rows[2].mul_(x[2])
        return y * 3 + 1, z + 1, torch.stack(rows) - 1


def test_a_value_written_in_place_is_not_folded():
    model, x = WrittenAfterFolding().eval(), torch.randn(4, 4)
    folded, _ = fold(export(model, (x,)))
    ops = ops_of(folded)
    assert ops.count("aten.mul.Tensor") == 3  # w * 2 and table * 5 stay ops (their data is written), y * 3
    assert "aten.clone.default" in ops and "aten.unbind.int" in ops
    folded_constants = [c for name, c in folded.constants.items() if name.startswith("_folded")]
    assert [c.dtype for c in folded_constants] == [torch.int64]  # only the index tensor
    artifact = compiler.compile(model, (x,), backend="portable", reproducer=False)
    for _ in range(2):  # the writes do not outlive a call
        for out, want in zip(compiler.run(artifact, (x,)), model(x), strict=True):
            torch.testing.assert_close(out, want)
    x2 = torch.randn(4, 4)
    for out, want in zip(compiler.run(artifact, (x2,)), model(x2), strict=True):
        torch.testing.assert_close(out, want)


class ScaledByTransposed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return x @ self.w.t()  # `t` of a parameter folds


def test_a_user_input_named_like_a_builtin_keeps_its_name_through_folding():
    """nn.Sequential's forward takes `input`; FX's deep copy renamed it `input_1`, the
    signature kept `input`, and fold found no placeholder for its user input (StopIteration)."""
    model, x = torch.nn.Sequential(ScaledByTransposed()).eval(), torch.randn(2, 8)
    folded, metrics = fold(export(model, (x,)))
    assert metrics["folded"] == 1
    placeholders = [n.name for n in folded.graph.nodes if n.op == "placeholder"]
    assert placeholders == [s.arg.name for s in folded.graph_signature.input_specs]
    assert "input" in placeholders
    folded._validate()
    artifact = compiler.compile(model, (x,), "portable")
    assert torch.allclose(compiler.run(artifact, (x,))[0], model(x), atol=1e-5)


def _torchao_int4_linear():
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_api import IntxWeightOnlyConfig, quantize_

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16)).eval()
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    return model, torch.randn(3, 64)


def test_torchao_weight_folds_into_its_int8_parts_and_stays_quantized():
    """The quantized weight (a tensor subclass) folds into its parts (qdata, scale,
    zero_point); the dequantize stays an op, so the weight is stored as int8, not float."""
    model, x = _torchao_int4_linear()
    folded, metrics = fold(export(model, (x,)))
    assert metrics["folded"] == 3
    assert "torchao.dequantize_affine.default" in ops_of(folded)
    assert "export.access_subclass_inner_tensor.default" not in ops_of(folded)
    assert sorted(str(v.dtype) for v in folded.constants.values()) == ["torch.float32", "torch.int8", "torch.int8"]
    with torch.no_grad():
        assert torch.allclose(folded.module()(x), model(x), atol=1e-5)


def test_torchao_int4_linear_on_portable_is_a_named_error_not_a_crash():
    """The runtime has no kernel for torchao.dequantize_affine (stock: "Missing out variants")."""
    model, x = _torchao_int4_linear()
    with pytest.raises(compiler.CompileError, match="torchao.dequantize_affine.default") as err:
        compiler.compile(model, (x,), "portable")
    assert err.value.stage == "partition" and "no kernel" in err.value.reason


class InputFree(torch.nn.Module):
    def forward(self):
        return torch.arange(6) * 2, torch.arange(1, 7, 2, dtype=torch.float32)


def test_a_program_without_inputs_folds_and_runs():
    model = InputFree()
    artifact = compiler.compile(model, (), "portable")
    for out, expected in zip(compiler.run(artifact, ()), model(), strict=True):
        assert out.dtype == expected.dtype and torch.equal(out, expected)

