"""Camera frames: ops reading uint8/int8/bfloat16 from outside Core ML run on the CPU, up to the float conversion."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.backends.coreml.payload import read_models
from coreml_helpers import compile_coreml, cpu_ops, cpu_reasons, delegated_ops, models, stock_error, stock_pte


class Frame(nn.Module):
    def __init__(self, pad_mode=None):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.pad_mode = pad_mode

    def forward(self, frame):
        x = frame.permute(0, 3, 1, 2).float() / 255
        if self.pad_mode:
            x = F.pad(x, (1, 1, 1, 1), mode=self.pad_mode)
        return self.conv(x)


class UnbindFrames(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, frames):
        outs = [self.conv(F.pad(f.permute(0, 3, 1, 2).float() / 255, (1, 1, 1, 1))) for f in frames.unbind(1)]
        return torch.cat(outs, 1)


def _frame(*shape):
    return torch.randint(0, 255, shape, dtype=torch.uint8)


def test_camera_frame_only_ops_before_float_conversion_on_cpu():
    model, inputs = Frame(), (_frame(1, 8, 8, 3),)
    assert "KeyError: torch.uint8" in stock_error(model, inputs)

    artifact = compile_coreml(model, inputs)
    assert sorted(cpu_ops(artifact).values()) == [
        "aten.permute_copy.default",
        "dim_order_ops._to_dim_order_copy.default",  # the .float()
    ]
    assert "aten.conv2d.default" in delegated_ops(artifact)
    assert "aten.div.Tensor" in delegated_ops(artifact)
    reasons = cpu_reasons(artifact)
    assert "reads frame (uint8) from outside its Core ML partition" in reasons["aten_permute_copy_default"]
    (model_,) = models(artifact)
    assert "conv" in model_.op_types()


def test_reflect_pad_after_conversion_stays_in_core_ml():
    artifact = compile_coreml(Frame("reflect"), (_frame(1, 8, 8, 3),))
    assert len(cpu_ops(artifact)) == 2
    (model_,) = models(artifact)
    (pad,) = model_.ops_of_type("pad")
    assert pad.constants["mode"] == "reflect"


def test_unbind_of_frames_followed_by_pad():
    model, inputs = UnbindFrames(), (_frame(1, 2, 8, 8, 3),)
    assert "KeyError: torch.uint8" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    on_cpu = sorted(set(cpu_ops(artifact).values()))
    # Only the uint8 part (unbind = slice + squeeze, permute, float) runs on the CPU.
    assert on_cpu == [
        "aten.permute_copy.default",
        "aten.slice_copy.Tensor",
        "aten.squeeze_copy.dims",
        "dim_order_ops._to_dim_order_copy.default",
    ]
    assert delegated_ops(artifact).count("aten.pad.default") == 2
    assert artifact.program.delegates == ("CoreMLBackend",)


class SplitFrames(nn.Module):
    def forward(self, frames):
        a, b = frames.split(1, dim=0)  # a multi-output op on uint8
        return a.float() * 2 + b.float()


def test_tensors_followed_through_multi_output_ops():
    artifact = compile_coreml(SplitFrames(), (_frame(2, 4),))
    ops = sorted(cpu_ops(artifact).values())
    assert "aten.split_with_sizes_copy.default" in ops or "aten.split_copy.Tensor" in ops
    assert ops.count("dim_order_ops._to_dim_order_copy.default") == 2
    assert "aten.mul.Tensor" in delegated_ops(artifact)


class Int8Out(nn.Module):
    def forward(self, x):
        return (x * 10).to(torch.int8), x + 1


def test_int8_result_used_outside_core_ml_stays_on_cpu():
    # Stock builds, but its Core ML model gives the int8 result as int32.
    (stock,) = read_models(stock_pte(Int8Out(), (torch.randn(4),)))
    given = {name: dtype for op in stock.ops for name, dtype in op.outputs.items() if name in stock.outputs}
    assert given[stock.outputs[0]] == "int32"

    artifact = compile_coreml(Int8Out(), (torch.randn(4),))
    reasons = cpu_reasons(artifact)
    assert list(cpu_ops(artifact).values()) == ["dim_order_ops._to_dim_order_copy.default"]
    assert "int8 result is used outside Core ML" in next(iter(reasons.values()))


class BF16(nn.Module):
    def forward(self, x):
        return x.float() * 2


def test_bfloat16_input_read_on_cpu():
    model, inputs = BF16(), (torch.randn(2, 4, dtype=torch.bfloat16),)
    assert "KeyError: torch.bfloat16" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    assert list(cpu_ops(artifact).values()) == ["dim_order_ops._to_dim_order_copy.default"]
    assert "aten.mul.Tensor" in delegated_ops(artifact)


class NoInputs(nn.Module):
    def forward(self, x):
        return torch.cumsum(x, 0), torch.arange(4).float() * 2


def test_partition_without_inputs_needs_ios18():
    model, inputs = NoInputs(), (torch.randn(4),)
    skip = ["aten.cumsum.default"]
    assert "iOS18" in stock_error(model, inputs, skip_ops_for_coreml_delegation=skip)

    artifact = compile_coreml(model, inputs, skip_ops_for_coreml_delegation=skip)
    assert artifact.program.delegates == ()
    assert any("no tensor inputs" in r for r in cpu_reasons(artifact).values())

    ios18 = compile_coreml(model, inputs, skip_ops_for_coreml_delegation=skip, minimum_deployment_target="iOS18")
    assert ios18.program.delegates == ("CoreMLBackend",)
    assert list(cpu_ops(ios18).values()) == ["aten.cumsum.default"]


class HalfInput(nn.Module):
    def forward(self, x):
        return (x * 2).sin()


def test_float16_inputs_stay_on_the_cpu_below_ios16_and_are_delegated_from_it():
    model, inputs = HalfInput(), (torch.randn(2, 4, dtype=torch.float16),)
    assert "To use fp16 input, please set minimum deployment target to iOS16+" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    assert any("float16 inputs only from iOS 16" in r for r in cpu_reasons(artifact).values())
    artifact = compile_coreml(model, inputs, minimum_deployment_target="iOS16")
    assert not cpu_ops(artifact)
