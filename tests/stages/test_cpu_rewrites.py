"""A 3-D convolution (or a transposed one) left on the CPU runs, as 2-D convolutions the
portable kernel takes.

The portable `convolution.out` refuses a 5-D input ("Expect input tensor to be 3-D or
4-D"); before the partition stage rewrote such calls, a model with an `nn.Conv3d` (a VLA
policy's patch embedding) compiled for portable and failed when it ran.
"""

from __future__ import annotations

import pytest
import torch

import compiler
from compiler.ir.dialect import op_name
from compiler.ir.errors import VerificationError
from compiler.ir.graph import DELEGATION_TAG
from compiler.passes.cpu_rewrites import rewrite_for_cpu_kernels


def _conv3d(**options) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    channels = options.pop("channels", 2)
    kind = torch.nn.ConvTranspose3d if options.pop("transposed", False) else torch.nn.Conv3d
    module = kind(channels, 6, options.pop("kernel_size", 3), **options).eval()
    return module, (torch.randn(2, channels, 7, 6, 5),)


CONVS = {
    "plain": {"padding": 1},
    # stride, padding and dilation differ per axis; groups split the channels
    "every-argument": {
        "channels": 4, "kernel_size": (3, 2, 3), "stride": (2, 1, 2), "padding": (2, 1, 0), "dilation": (2, 1, 1),
        "groups": 2,
    },
    "patch-embedding": {"kernel_size": (2, 3, 3), "stride": (2, 3, 3), "bias": False},  # a video ViT's: no overlap
    "transposed": {"transposed": True, "stride": 2, "padding": 1},
    "transposed-every-argument": {
        "transposed": True, "channels": 4, "kernel_size": (3, 2, 3), "stride": (2, 1, 2), "padding": (1, 1, 0),
        "output_padding": (1, 0, 1), "dilation": (2, 1, 1), "groups": 2,
    },
}


def _close_to_eager(artifact, module, inputs) -> None:
    with torch.no_grad():
        want = module(*inputs)
    torch.testing.assert_close(compiler.run(artifact, inputs)[0], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CONVS))
def test_conv3d_runs_on_portable_as_in_eager(case):
    module, inputs = _conv3d(**CONVS[case])
    _close_to_eager(compiler.compile(module, inputs, backend="portable"), module, inputs)


def test_conv3d_xnnpack_refuses_runs_on_the_cpu_rewritten_with_both_reasons():
    module, inputs = _conv3d(padding=1)
    artifact = compiler.compile(module, inputs, backend="xnnpack")
    _close_to_eager(artifact, module, inputs)
    plan = artifact.stages["partition"].plan
    convolutions = [p for p in plan.cpu_nodes if p.op == "aten.convolution.default"]
    assert len(convolutions) == 3  # one per depth tap
    for placed in convolutions:
        assert placed.reason.startswith("XNNPACK's partitioner refused it: Only support 1D + 2D Conv; ")
        assert "aten_convolution_default was rewritten, since the portable kernel refuses input of rank 5" in (
            placed.reason
        )


def test_a_delegated_conv3d_is_left_to_its_delegate():
    module, inputs = _conv3d(padding=1)
    program = compiler.compile(module, inputs, backend="portable", stop_after="decompose").artifact.program
    (conv,) = [n for n in program.graph.nodes if "convolution" in str(n.target)]
    conv.meta[DELEGATION_TAG] = "tag0"  # as a delegate that takes 3-D convolutions (Core ML) tags it
    assert rewrite_for_cpu_kernels(program, lambda n: "") == {}
    assert conv in program.graph.nodes and conv.meta[DELEGATION_TAG] == "tag0"


@pytest.mark.slow
def test_core_ml_takes_the_conv3d_whole_and_it_is_not_rewritten():
    module, inputs = _conv3d(padding=1)
    program = compiler.compile(module, inputs, backend="coreml", stop_after="partition").artifact.program
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    assert [op_name(n.target) for n in calls] == ["aten.conv3d.default"] and calls[0].meta.get(DELEGATION_TAG)


def test_conv3d_with_a_symbolic_batch_is_refused_at_compile_time_by_name():
    module, inputs = _conv3d(padding=1)
    batch = torch.export.Dim("batch", min=2, max=8)
    with pytest.raises(VerificationError) as caught:
        compiler.compile(module, inputs, backend="portable", dynamic_shapes=({0: batch},))
    error = caught.value
    assert (error.stage, error.invariant) == ("partition", "cpu_ops_have_kernels")
    assert error.nodes == (
        "aten_convolution_default (aten.convolution.default: the runtime's kernel refuses input of rank 5 "
        "(a 3-D convolution), not transposed: kernels/portable/cpu/util/kernel_ops_util.cpp:check_convolution_args: "
        'in.dim() == 3 || in.dim() == 4: "Expect input tensor to be 3-D or 4-D")',
    )
