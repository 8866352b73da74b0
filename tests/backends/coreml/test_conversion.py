"""Conversion fixes, checked in the MIL program inside the Core ML payload."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY

from compiler.backends.coreml import conversion
from compiler.backends.coreml.payload import read_models
from coreml_helpers import assert_matches_eager, compile_coreml, cpu_ops, models, stock_error, stock_pte


class IntFill(nn.Module):
    def forward(self, x):
        return x + 1, torch.full((1, 16), 0)


def _output_dtype(model_, name):
    for op in model_.ops:
        if name in op.outputs:
            return op.outputs[name]
    raise AssertionError(f"no op gives {name}")


def test_fill_keeps_torch_dtype():
    model, inputs = IntFill(), (torch.randn(2, 4),)
    (stock,) = read_models(stock_pte(model, inputs))
    assert _output_dtype(stock, "aten_full_default") == "float32"  # torch says int64

    artifact = compile_coreml(model, inputs)
    (ours,) = models(artifact)
    assert _output_dtype(ours, "aten_full_default") == "int32"
    assert_matches_eager(artifact, model, inputs)


class Gelu(nn.Module):
    def forward(self, x):
        return F.gelu(x, approximate="tanh")


def test_gelu_tanh_converts_as_tanh_approximation():
    model, inputs = Gelu(), (torch.randn(2, 4),)
    (stock,) = read_models(stock_pte(model, inputs))
    assert stock.ops_of_type("gelu")[0].constants["mode"] == "EXACT"
    artifact = compile_coreml(model, inputs)
    (ours,) = models(artifact)
    assert ours.ops_of_type("gelu")[0].constants["mode"] == "TANH_APPROXIMATION"
    assert_matches_eager(artifact, model, inputs)


class RMS(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(4)  # eps=None: torch uses float32 machine epsilon

    def forward(self, x):
        return self.norm(x)


def test_rms_norm_without_eps_gets_machine_epsilon():
    model, inputs = RMS(), (torch.randn(2, 4),)
    assert "got 3 input(s), expected [4]" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    assert not cpu_ops(artifact)
    (ours,) = models(artifact)
    assert "reduce_mean" in ours.op_types() and "sqrt" in ours.op_types()
    assert_matches_eager(artifact, model, inputs)


class Repeats(nn.Module):
    def forward(self, x):
        return x.clone(), x * 2


def test_output_repeating_an_input_gets_its_own_copy():
    model, inputs = Repeats(), (torch.randn(2, 4),)
    (stock,) = read_models(stock_pte(model, inputs))
    assert stock.outputs[0] in stock.inputs  # stock returns the input itself
    artifact = compile_coreml(model, inputs)
    (ours,) = models(artifact)
    assert len(set(ours.outputs)) == 2
    assert not set(ours.outputs) & set(ours.inputs)
    assert_matches_eager(artifact, model, inputs)


def test_fixes_are_active_only_while_lowering():
    before = dict(_TORCH_OPS_REGISTRY.name_to_func_mapping)
    with conversion.installed():
        assert _TORCH_OPS_REGISTRY.name_to_func_mapping["gelu"] is not before["gelu"]
    assert _TORCH_OPS_REGISTRY.name_to_func_mapping == before


class FloatZerosOfMask(nn.Module):
    """What nn.MultiheadAttention does with a bool mask: zeros_like(mask, dtype=float)."""

    def forward(self, x):
        mask = x > 0
        return torch.zeros_like(mask, dtype=torch.float).masked_fill(mask, -1.0) + x


def test_zeros_like_of_bool_mask_converts_as_float():
    model, inputs = FloatZerosOfMask(), (torch.randn(2, 4),)
    (stock,) = read_models(stock_pte(model, inputs))
    artifact = compile_coreml(model, inputs)
    (ours,) = models(artifact)
    # Stock fills with bool, so masked_fill(-1.0) computes in bool (-1 becomes True, i.e. 1.0).
    assert list(stock.ops_of_type("select")[0].outputs.values()) == ["bool"]
    assert list(ours.ops_of_type("select")[0].outputs.values()) == ["float16"]
    assert_matches_eager(artifact, model, inputs)


class BoolMaskAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x, mask):
        return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]


def test_multihead_attention_with_bool_mask_fills_the_mask_as_float():
    model = BoolMaskAttention().eval()
    inputs = (torch.randn(1, 4, 8), torch.triu(torch.ones(4, 4, dtype=torch.bool), 1))
    # Stock builds, but fills zeros_like(mask, dtype=float) as bool: masked_fill(-inf) then
    # computes in bool, so the additive mask is 0/1 instead of 0/-inf.
    (stock,) = read_models(stock_pte(model, inputs))
    assert _output_dtype(stock, "aten_zeros_like_default") == "bool"
    assert [list(op.outputs.values()) for op in stock.ops_of_type("select")] == [["bool"]]

    artifact = compile_coreml(model, inputs)
    assert not cpu_ops(artifact)
    assert artifact.program.delegates == ("CoreMLBackend",)
    (ours,) = models(artifact)
    zeros = [op for op in ours.ops if op.name.startswith("aten_zeros_like_default")]
    assert zeros and all(d == "float16" for op in zeros for d in op.outputs.values())
    (fill,) = ours.ops_of_type("select")  # the mask fill, computed as float
    assert list(fill.outputs.values()) == ["float16"]
    assert "softmax" in ours.op_types()
    assert_matches_eager(artifact, model, inputs)


class WhereOfScalars(nn.Module):
    def forward(self, x):
        return torch.where(x.sum() > 0, x.amax(), x.amin()) * 2


def test_where_of_zero_dim_tensors_converts_to_select():
    model, inputs = WhereOfScalars(), (torch.randn(2, 3),)
    assert "Concat concat_0 got 0 values" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    assert not cpu_ops(artifact)
    (ours,) = models(artifact)
    assert ours.ops_of_type("select")


class MaxPool1d(nn.Module):
    def forward(self, x):
        return F.max_pool1d(x, 2) * 2, F.max_pool1d(x, 3, return_indices=True)[0]


def test_a_max_pool_without_stride_gets_its_kernel_size():
    model, inputs = MaxPool1d(), (torch.randn(1, 2, 9),)
    assert "expected minimum 3 inputs" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    assert not cpu_ops(artifact)
    (ours,) = models(artifact)
    pools = ours.ops_of_type("max_pool")
    assert sorted((op.constants["kernel_sizes"], op.constants["strides"]) for op in pools) == [(2, 2), (3, 3)]


class MaskWrittenThenRead(nn.Module):
    """A bool mask written by positions, then read by: coremltools scatters bool data as int32
    and left it int32, so the read gathered rows 0 and 1 by the mask's values: (1, 8, 3)."""

    def forward(self, a):
        mask = torch.zeros(8, dtype=torch.bool)
        mask[[0, 1, 2, 3, 4, 5]] = True
        return a[:, mask] * 2


def test_an_index_put_into_bool_data_gives_bool_data():
    model, inputs = MaskWrittenThenRead(), (torch.randn(1, 8, 3),)
    assert "must have the same data type" in stock_error(model, inputs)  # stock fills the mask as float
    artifact = compile_coreml(model, inputs)
    (ours,) = models(artifact)
    assert _output_dtype(ours, "aten_index_put_default") == "int32"  # coremltools' scatter
    assert _output_dtype(ours, "aten_index_put_default_as_bool") == "bool"
    assert_matches_eager(artifact, model, inputs)


class Prelu(nn.Module):
    def forward(self, x, weight):
        return F.prelu(x, weight)


def test_prelu_of_a_weight_given_at_run_time_or_of_a_0_d_input_converts_as_torch_computes_it():
    """coremltools takes prelu's weight as a constant ("unsupported operand type(s) for *: 'float'
    and 'NoneType'" for a program input) of an input of rank 1 or more ("Axis value 2 is out of
    bounds" for a 0-d one); both become x where x >= 0, weight * x elsewhere, on Core ML."""
    for inputs in [(torch.randn(2, 3, 4), torch.rand(3)), (torch.tensor(-1.5), torch.rand(1))]:
        model = Prelu()
        assert stock_error(model, inputs)
        artifact = compile_coreml(model, inputs, compute_precision="float32")
        assert not cpu_ops(artifact)
        assert_matches_eager(artifact, model, inputs)


class TripletMarginLoss(nn.Module):
    """clamp_min(distance difference, 0): an int literal bound of a float tensor."""

    def forward(self, anchor, positive, negative):
        return F.triplet_margin_with_distance_loss(anchor, positive, negative, swap=True)


def test_clamp_min_by_an_integer_literal_of_a_float_tensor_converts():
    model, inputs = TripletMarginLoss(), tuple(torch.randn(5, 10) for _ in range(3))
    assert "AssertionError" in stock_error(model, inputs)  # coremltools: x.dtype == y.dtype
    artifact = compile_coreml(model, inputs, compute_precision="float32")
    assert not cpu_ops(artifact)
    assert_matches_eager(artifact, model, inputs)
