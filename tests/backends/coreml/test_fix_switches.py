"""Each of our Core ML conversion fixes, switched off (`fixes.fixes_off`), lets a silent
coremltools bug through and the check (`compare_with_eager`: CPU kernels with torch, each
Core ML payload in the MIL reference interpreter) fails on its case; switched on, it passes.

The cases compute in float32 (backend option compute_precision) where the bug is below float16's
resolution (tanh GELU: 4.7e-4) or in integers float16 keeps but float32 does not (above
2**24); the check then holds the program to 1e-4 absolute. The index_put refusals are the
exception, told at their tests: switched off, the check finds no wrong number for two
refused forms (one it cannot run yet) and refuses the third, a malformed scatter.
"""

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compiler
from compiler.backends.coreml import fixes
from compiler.backends.coreml.fixes import fixes_off
from compiler.backends.coreml.interpreter import MilInterpreterError, UnsupportedMilOp, load_programs
from compiler.backends.coreml.reference import AliasedPayloadOutput
from compiler.running.runtime import compare_with_eager
from compiler.running.tolerance import FLOAT32_ABSOLUTE
from coreml_helpers import compile_coreml, cpu_ops, models, stock_pte

FP32 = {"compute_precision": "float32"}


def _output_dtype(payload, name):
    (dtype,) = [op.outputs[name] for op in payload.ops if name in op.outputs]
    return dtype


def _on_and_off(switch, model, inputs, **options):
    """The model compiled with every fix on, and with `switch` off. The fix-off compile skips
    verify-each, so what the check sees is the payload's numbers (an invariant refuses some
    such payloads outright: test_an_epsilon_left_in_a_payload_is_refused_by_verify_each)."""
    on = compile_coreml(model, inputs, **options)
    with fixes_off(switch):
        off = compiler.compile(model.eval(), inputs, "coreml", backend_options=options or None, verify=False)
    return on, off


# --- the switch itself ---------------------------------------------------------------


def test_an_unknown_fix_is_named_with_the_known_ones():
    with pytest.raises(ValueError) as caught:
        with fixes_off("tanh_gelu", "mha_mask"):
            pass
    message = str(caught.value)
    assert "'mha_mask'" in message and all(name in message for name in fixes.FIXES)
    assert fixes.on("tanh_gelu")  # nothing was turned off


def test_switches_nest_and_come_back_on():
    with fixes_off("tanh_gelu"):
        with fixes_off("tanh_gelu", "fill_dtypes"):
            assert not fixes.on("tanh_gelu") and not fixes.on("fill_dtypes")
        assert not fixes.on("tanh_gelu") and fixes.on("fill_dtypes")
    assert all(fixes.on(name) for name in fixes.FIXES)


# --- tanh GELU ----------------------------------------------------------------------


class TanhGelu(nn.Module):
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


def test_tanh_gelu():
    model, inputs = TanhGelu(), (torch.linspace(-4, 4, 257).reshape(1, 257),)
    on, off = _on_and_off("tanh_gelu", model, inputs, **FP32)
    assert [m.ops_of_type("gelu")[0].constants["mode"] for m in (*models(on), *models(off))] == [
        "TANH_APPROXIMATION", "EXACT",
    ]
    bad = compare_with_eager(off, model, inputs)
    # The exact GELU instead: tanh GELU's largest distance from it, below float16's resolution.
    assert 4.5e-4 < bad.max_abs_error < 4.8e-4 and not bad.passed
    assert bad.tolerance.absolute == FLOAT32_ABSOLUTE
    good = compare_with_eager(on, model, inputs)
    assert good.passed and good.max_abs_error < 1e-6


# --- fill dtypes --------------------------------------------------------------------


class IntFill(nn.Module):
    """Token ids offset by a fill: int64 in torch; stock fills fp32 (`full` defaults to float)."""

    def __init__(self, offset):
        super().__init__()
        self.offset = offset

    def forward(self, ids):
        return torch.full((1, 16), self.offset) + ids


def test_int_fill_keeps_integers_float32_cannot_hold():
    # float32 compute precision, values just above 2**24: the float fill loses the odd ones
    # (16777217 -> 16777216), and so did our fix while it cast the float fill to int32.
    model, inputs = IntFill(2**24 + 1), (torch.arange(16).reshape(1, 16),)
    on, off = _on_and_off("fill_dtypes", model, inputs, **FP32)
    assert not cpu_ops(on) and not cpu_ops(off)
    bad = compare_with_eager(off, model, inputs)
    assert bad.max_abs_error == 2 and not bad.passed  # 16777216.0 + 1 rounds to 16777216, not 16777218
    good = compare_with_eager(on, model, inputs)
    assert good.passed and good.max_abs_error == 0


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # coremltools, on the fp16 fill
def test_int_fill_in_float16_fails_the_exact_integer_check():
    """float16 compute precision (the default): the float fill holds integers up to 2**11
    only, 2049 + ids comes out 2 off. The check's float16 tolerance (1e-2 of the largest
    float output) is for float outputs; integer outputs must match exactly."""
    model, inputs = IntFill(2049), (torch.arange(16).reshape(1, 16),)
    on, off = _on_and_off("fill_dtypes", model, inputs)
    bad = compare_with_eager(off, model, inputs)
    assert bad.integer_error == 2 and not bad.passed
    assert "integer outputs differ by up to 2 (they must match exactly)" in bad.describe()
    good = compare_with_eager(on, model, inputs)
    assert good.passed and not good.max_abs_error


class MaskedScores(nn.Module):
    """Attention with a bool mask made additive as nn.MultiheadAttention makes it
    (`zeros_like(mask, dtype=float).masked_fill(mask, -inf)`), written out: stock fills the
    zeros as bool (zeros_like reads its dtype positionally only), the masked_fill then computes
    in bool and the mask adds 1 where it should add -inf."""

    def forward(self, q, k, mask):
        additive = torch.zeros_like(mask, dtype=q.dtype).masked_fill(mask, float("-inf"))
        return (q @ k.transpose(-1, -2) / 2 + additive).softmax(-1)


def _causal_inputs():
    torch.manual_seed(0)
    return torch.randn(1, 4, 8), torch.randn(1, 4, 8), torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)


def test_bool_mask_filled_as_float():
    model, inputs = MaskedScores(), _causal_inputs()
    on, off = _on_and_off("fill_dtypes", model, inputs, **FP32)
    assert not cpu_ops(on) and not cpu_ops(off)
    bad = compare_with_eager(off, model, inputs)
    assert bad.max_abs_error > 0.1 and not bad.passed  # masked positions get weight
    good = compare_with_eager(on, model, inputs)
    assert good.passed and good.max_abs_error < 1e-6


class MultiheadAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x, mask, padding):
        return self.attn(x, x, x, attn_mask=mask, key_padding_mask=padding, need_weights=False)[0]


def test_multihead_attention_with_bool_masks_passes_with_the_fill_fix_on_and_off():
    """nn.MultiheadAttention's mask fill is the same `zeros_like(mask, dtype=float)` as above,
    fixed by the same code, so it has the same switch (`fill_dtypes`). But it fills in place
    (`masked_fill_`), which our decomposition turns into `where`, whose converter promotes
    the bool zeros to float: without the fix the module still comes out right, and the check
    rightly passes both ways."""
    torch.manual_seed(0)
    model = MultiheadAttention().eval()
    x, _, mask = _causal_inputs()
    inputs = (x, mask, torch.tensor([[False, False, False, True]]))
    on, off = _on_and_off("fill_dtypes", model, inputs, **FP32)
    assert not cpu_ops(on) and not cpu_ops(off)
    # With the fix the mask's zeros are float; without, bool, which `where` then promotes.
    assert _output_dtype(*models(on), "aten_zeros_like_default") == "float32"
    assert _output_dtype(*models(off), "aten_zeros_like_default_promoted") == "float32"
    for artifact in (on, off):
        check = compare_with_eager(artifact, model, inputs)
        assert check.passed and check.max_abs_error < 1e-6


# --- never alias --------------------------------------------------------------------


class ReturnsItsInput(nn.Module):
    def forward(self, x):
        return x.clone(), x + 1


def test_never_alias():
    model, inputs = ReturnsItsInput(), (torch.randn(3),)
    on, off = _on_and_off("never_alias", model, inputs, **FP32)
    (payload,) = models(off)
    assert payload.outputs[0] in payload.inputs  # the clone is the input itself
    with pytest.raises(AliasedPayloadOutput):
        compare_with_eager(off, model, inputs)
    good = compare_with_eager(on, model, inputs)
    assert good.passed and good.max_abs_error == 0


class AtLeast2dOfSeveral(nn.Module):
    def forward(self, x, y):
        return torch.atleast_2d([x, y])


def test_never_alias_in_a_sequence_of_results():
    """atleast_2d of a list gives the tensors of rank 2 or more back as they are: each such result
    of the sequence is an input of the payload, unless it gets an identity (OpInfo's sample)."""
    model, inputs = AtLeast2dOfSeveral(), (torch.randn(2, 3), torch.randn(4))
    on, off = _on_and_off("never_alias", model, inputs, **FP32)
    with pytest.raises(AliasedPayloadOutput):
        compare_with_eager(off, model, inputs)
    good = compare_with_eager(on, model, inputs)
    assert good.passed and good.max_abs_error == 0


# --- index_put refusals ---------------------------------------------------------------


class IndexPut(nn.Module):
    """One index_put between two ops Core ML takes (so its neighbours stay delegated)."""

    def __init__(self, indices, accumulate=False):
        super().__init__()
        self.indices, self.accumulate = indices, accumulate

    def forward(self, y, i, v):
        indices = self.indices(y, i)
        return torch.ops.aten.index_put.default(y * 2, indices, v + 1, self.accumulate) - 1


# The refused forms whose stock text is None: coremltools converts them without a word.
SILENT_FORMS = {
    "accumulate": (
        IndexPut(lambda y, i: [i], accumulate=True),
        (torch.randn(5, 3), torch.tensor([0, 0, 2]), torch.randn(3, 3)),
    ),
    "bool-mask-below-ios18": (
        IndexPut(lambda y, i: [y > i]),
        (torch.randn(3, 4), torch.tensor([0.0]), torch.tensor([5.0])),
    ),
    "0-d-next-to-slice-values-vary": (  # y[:, i] = v, i a 0-d index made in the program
        IndexPut(lambda y, i: [None, i[0]]),
        (torch.randn(2, 4, 3), torch.tensor([1]), torch.arange(6.0).reshape(2, 3)),
    ),
}


@pytest.fixture(scope="module")
def index_put_forms():
    return {name: _on_and_off("index_put_refusals", *case, **FP32) for name, case in SILENT_FORMS.items()}


@pytest.mark.parametrize("form", list(SILENT_FORMS))
def test_index_put_refusals_on_keep_the_form_on_the_cpu_and_pass(index_put_forms, form):
    on, off = index_put_forms[form]
    assert "aten.index_put.default" in cpu_ops(on).values()
    assert not cpu_ops(off)  # refusals off: the whole program is one Core ML payload
    model, inputs = SILENT_FORMS[form]
    check = compare_with_eager(on, model, inputs)
    assert check.passed and check.max_abs_error < 1e-5


def test_index_put_accumulate_refusal_off_finds_no_wrong_number(index_put_forms):
    """coremltools converts accumulate=True to scatter_nd(mode="add"), which accumulates
    repeated indices (the MIL spec, and the interpreter, agree with torch): the refusal is not
    backed by a wrong number the check can show."""
    _, off = index_put_forms["accumulate"]
    (payload,) = models(off)
    assert [op.constants["mode"] for op in payload.ops_of_type("scatter_nd")] == ["add"]
    model, inputs = SILENT_FORMS["accumulate"]
    check = compare_with_eager(off, model, inputs)
    assert check.passed and check.max_abs_error < 1e-5


def test_index_put_bool_mask_below_ios18_refusal_off(index_put_forms):
    """A bool mask converts to non_zero + scatter_nd. Run with a non_zero kernel (and a
    slice_by_index that ignores `end` where it squeezes), it matches torch: like accumulate,
    no wrong number backs this refusal."""
    _, off = index_put_forms["bool-mask-below-ios18"]
    model, inputs = SILENT_FORMS["bool-mask-below-ios18"]
    assert compare_with_eager(off, model, inputs).passed


def test_index_put_zero_d_index_next_to_slice_refusal_off_is_malformed(index_put_forms):
    """`y[:, i] = v` with a 0-d i and v of shape (2, 3): coremltools writes a (2, 1, 3) block and
    tiles v to (2, 2, 3) for it, so its scatter gets 12 updates for 6 positions. The check
    refuses to run that program (what Core ML does with it, the MIL spec does not say)."""
    _, off = index_put_forms["0-d-next-to-slice-values-vary"]
    [program] = load_programs(off.pte)
    [scatter] = [op for op in program.functions["main"].operations if op.op_type == "scatter"]
    assert scatter.inputs["updates"].shape == (12,)
    assert scatter.inputs["indices"].shape != (12,)  # (6 * is34,): is34 is 1 at run time
    model, inputs = SILENT_FORMS["0-d-next-to-slice-values-vary"]
    with pytest.raises(MilInterpreterError, match=r"\(scatter\) cannot run on its operands.*\(12,\).*\(6,\)"):
        compare_with_eager(off, model, inputs)


# --- unary ops without Core ML's default epsilon ---------------------------------------


class Unary(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


_SMALL = torch.tensor([[1e-3, 0.5, 2.0, -0.01]])


def test_one_over_x_is_exact_not_inverse_with_epsilon():
    """`1 / x` becomes reciprocal, which stock converts to MIL's inverse with its default
    epsilon 1e-4: 1/(1e-3 + 1e-4) = 909.1, not 1000."""
    from executorch.backends.apple.coreml.compiler import CoreMLBackend
    import coremltools as ct

    model, inputs = Unary(lambda x: 1 / x), (_SMALL,)
    fp32_spec = [CoreMLBackend.generate_compute_precision_compile_spec(ct.precision.FLOAT32)]
    stock = compare_with_eager(stock_pte(model, inputs, compile_specs=fp32_spec), model, inputs)
    assert 90.8 < stock.max_abs_error < 91.0 and not stock.passed
    on, off = _on_and_off("unary_epsilon", model, inputs, **FP32)
    assert [op.type for m in models(off) for op in m.ops if op.type in ("inverse", "real_div")] == ["inverse"]
    assert [op.type for m in models(on) for op in m.ops if op.type in ("inverse", "real_div")] == ["real_div"]
    bad = compare_with_eager(off, model, inputs)
    assert 90.8 < bad.max_abs_error < 91.0 and not bad.passed
    good = compare_with_eager(on, model, inputs)
    assert good.passed and good.max_abs_error == 0


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # the kernel, on log(0)
@pytest.mark.parametrize(
    "fn, x, off_error",
    [
        (torch.reciprocal, _SMALL, (90.8, 91.0)),
        # 1/sqrt(1e-6 + 1e-12) = 999.9995: 1000 is below float32's step there, 5e-4 is not
        (torch.rsqrt, torch.tensor([[1e-6, 1e-3, 0.5, 2.0]]), (4e-4, 5e-4)),
        # log(0 + 1e-45) = -103.3, not -inf
        (torch.log, torch.tensor([[0.0, 1e-3, 0.5, 2.0]]), (float("inf"), float("inf"))),
        (torch.log2, torch.tensor([[0.0, 1e-3, 0.5, 2.0]]), (float("inf"), float("inf"))),
    ],
    ids=["reciprocal", "rsqrt", "log", "log2"],
)
def test_unary_ops_without_the_default_epsilon(fn, x, off_error):
    model, inputs = Unary(fn), (x,)
    on, off = _on_and_off("unary_epsilon", model, inputs, **FP32)
    bad = compare_with_eager(off, model, inputs)
    assert off_error[0] <= bad.max_abs_error <= off_error[1] and not bad.passed
    good = compare_with_eager(on, model, inputs)
    assert good.passed and good.max_abs_error == 0


def test_rsqrt_with_epsilon_zero_leaves_the_program_as_it_was():
    """Our rsqrt keeps its op (epsilon 0), so the MIL passes that match an rsqrt (the
    layer-norm fusions) see the same program as with stock's."""

    class HandWrittenRmsNorm(nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    model, inputs = HandWrittenRmsNorm(), (torch.randn(2, 8),)
    on, off = _on_and_off("unary_epsilon", model, inputs, **FP32)
    (on_ops,), (off_ops,) = ([[op.type for op in m.ops if op.type != "const"] for m in models(a)] for a in (on, off))
    assert on_ops == off_ops == ["pow", "reduce_mean", "add", "rsqrt", "mul"]
    assert compare_with_eager(on, model, inputs).passed


# --- softplus's threshold ---------------------------------------------------------------


class Softplus(nn.Module):
    def forward(self, x):
        return F.softplus(x, beta=2.0, threshold=5.0)


@pytest.mark.parametrize(
    "shape", [(1, 4), (1, 4, 1, 1)], ids=["rank2_softplus_over_beta", "rank4_softplus_parametric"]
)
def test_softplus_threshold(shape):
    # 2.6 and 3.0 are past the threshold (beta * x > 5): torch gives x; without the
    # threshold log1p(exp(-5.2)) / 2 = 2.75e-3 more at 2.6.
    model, inputs = Softplus(), (torch.tensor([[2.4, 2.6, 3.0, -1.0]]).reshape(shape),)
    on, off = _on_and_off("softplus_threshold", model, inputs, **FP32)
    bad = compare_with_eager(off, model, inputs)
    assert 2.7e-3 < bad.max_abs_error < 2.8e-3 and not bad.passed
    good = compare_with_eager(on, model, inputs)
    assert good.passed and good.max_abs_error < 1e-6


def test_softplus_default_threshold_converts_as_stock():
    """torch's default threshold (20, beta 1) changes nothing float32 can see: no select."""

    class DefaultSoftplus(nn.Module):
        def forward(self, x):
            return F.softplus(x)

    model, inputs = DefaultSoftplus(), (torch.tensor([[-30.0, 0.0, 19.0, 21.0, 40.0]]),)
    on, off = _on_and_off("softplus_threshold", model, inputs, **FP32)
    assert [[op.type for op in m.ops] for m in models(on)] == [[op.type for op in m.ops] for m in models(off)]
    assert "select" not in [op.type for m in models(on) for op in m.ops]
    assert compare_with_eager(on, model, inputs).passed


# --- clamp by tensor bounds -------------------------------------------------------------


class ClampByTensors(nn.Module):
    def forward(self, x, low, high):
        return torch.clamp(x, low, high)


def test_clamp_where_the_low_bound_is_above_the_high_one_gives_the_high_one():
    """torch's clamp is min(max(x, low), high); stock converts max(min(x, high), low), which
    gives low where low > high (the last element: 1 for torch's -1)."""
    x = torch.tensor([[-3.0, 0.5, 3.0, 0.0]])
    low, high = torch.tensor([[-1.0, -1.0, 2.0, 1.0]]), torch.tensor([[1.0, 1.0, 2.5, -1.0]])
    model, inputs = ClampByTensors(), (x, low, high)
    on, off = _on_and_off("clamp_order", model, inputs, **FP32)
    bad = compare_with_eager(off, model, inputs)
    assert bad.max_abs_error == 2 and not bad.passed
    good = compare_with_eager(on, model, inputs)
    assert good.passed and good.max_abs_error == 0
    assert not cpu_ops(on)  # converted, not kept off Core ML


# --- var and std without a correction ----------------------------------------------------


@pytest.mark.parametrize("fn", [torch.var, torch.std], ids=["var", "std"])
def test_var_and_std_over_every_dim_without_a_correction_divide_by_n_minus_one(fn):
    """torch.var(x) over every dim is `var.correction(x)`, its correction left out, which torch
    reads as 1; stock reads it as 0: the population value, sqrt(4 / 5) of torch's std over 5
    elements. (Over given dims they are `var.dim`, which stock converts right.)"""
    model, inputs = Unary(fn), (torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0]]),)
    on, off = _on_and_off("default_correction", model, inputs, **FP32)
    bad = compare_with_eager(off, model, inputs)
    population_share = 0.8**0.5 if fn is torch.std else 0.8  # (n - 1) / n, or its root for std
    assert not bad.passed and bad.max_abs_error == pytest.approx(float(fn(inputs[0])) * (1 - population_share), rel=1e-5)
    good = compare_with_eager(on, model, inputs)
    assert good.passed and good.max_abs_error < 1e-5


# --- log_softmax ------------------------------------------------------------------------


class LogSoftmax(nn.Module):
    def forward(self, x):
        return torch.log_softmax(x, -1)


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")  # the kernel, stock's log(0)
@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_log_softmax_where_softmax_underflows(precision):
    """Stock's log(softmax(x)): at -200 softmax is 0, so log(0 + 1e-45) = -103.3 in float32
    (96.7 off) and -inf in float16; torch gives -200."""
    model, inputs = LogSoftmax(), (torch.tensor([[0.0, -5.0, -20.0, -200.0]]),)
    on, off = _on_and_off("log_softmax", model, inputs, compute_precision=precision)
    bad = compare_with_eager(off, model, inputs)
    assert not bad.passed
    if precision == "float32":
        assert 96.6 < bad.max_abs_error < 96.8
    else:
        assert bad.max_abs_error == float("inf")
    good = compare_with_eager(on, model, inputs)
    assert good.passed and good.max_abs_error < (1e-5 if precision == "float32" else 1e-2)


def test_an_epsilon_left_in_a_payload_is_refused_by_verify_each():
    """The whole class: no torch op computes f(x + epsilon), so a payload whose inverse, rsqrt
    or log adds one (a default left in by a conversion) fails the lower stage's invariant."""
    from compiler.ir.errors import VerificationError

    model, inputs = Unary(lambda x: 1 / x), (_SMALL,)
    with fixes_off("unary_epsilon"), pytest.raises(VerificationError) as caught:
        compile_coreml(model, inputs, **FP32)
    assert "delegate_payloads_pass_their_backend_checks" in str(caught.value) and "epsilon" in str(caught.value)
    assert "aten_reciprocal_default (inverse, epsilon 0.0001)" in str(caught.value)


# --- where over a condition of a larger symbolic shape --------------------------------


class MaskOverPickedRows(nn.Module):
    """where of two numbers over a mask of u rows, u picked by a bool index (an attention mask's way)."""

    def forward(self, x, keep):
        rows = x[keep]
        later = rows[:, None, :, None] > rows[:, None, None, :]
        return torch.where(later, 0.0, float("-inf")) + rows[:, None, None, :]


# Distinct values 1/8 apart, exact in float16: Core ML compares them in float16, where random
# float32 values closer than its rounding can compare equal and flip the mask (an infinite error
# on about one draw in eight).
_PICKED_ROWS = (
    torch.randperm(96, generator=torch.Generator().manual_seed(0)).reshape(6, 16) / 8.0 - 6.0,
    torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool),
)


def test_select_shape():
    """Off, Core ML's select is declared 0-d, the shape of its two 0-d values, and computes the
    mask's (4, 1, 16, 16): the interpreter refuses it, as it refuses stock's payload."""
    model, inputs = MaskOverPickedRows(), _PICKED_ROWS
    on, off = _on_and_off("select_shape", model, inputs)
    for wrong in (off.pte, stock_pte(model, inputs)):
        with pytest.raises(MilInterpreterError, match=r"\(select\) has shape \(4, 1, 16, 16\), the program declares \(\)"):
            compare_with_eager(wrong, model, inputs)
    assert "aten.where.self" not in cpu_ops(on).values()
    assert compare_with_eager(on, model, inputs).passed
