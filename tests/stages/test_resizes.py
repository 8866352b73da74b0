"""Antialiased resizes (`interpolate(..., antialias=True)`) become two matrix products with
torch's own weights at capture: every backend runs them and agrees with eager. Without it the
bicubic one failed at decompose's verifier on every backend (not Core ATen) and Core ML computed
the bilinear one as a plain bilinear resize, 0.2 off eager with no error."""

import pytest
import torch

import compiler
from compiler.ir.errors import UserInputError
from compiler.passes.resizes import ANTIALIASED, resize_weights


class CameraResize(torch.nn.Module):
    """A policy's camera input: a uint8 frame scaled to [0, 1], resized from 96 to 64 px."""

    def __init__(self, mode: str, size=(64, 64)):
        super().__init__()
        self.mode, self.size = mode, size

    def forward(self, frame):
        x = frame.float() / 255
        return torch.nn.functional.interpolate(x, size=self.size, mode=self.mode, antialias=True)


FRAME = torch.randint(0, 256, (1, 3, 96, 96), dtype=torch.uint8)
slow = pytest.mark.slow


@pytest.mark.parametrize(
    "mode, backend",
    [
        ("bicubic", "portable"), ("bilinear", "coreml"), ("bicubic", "mlx"), ("bilinear", "xnnpack"),
        pytest.param("bilinear", "portable", marks=slow), pytest.param("bicubic", "xnnpack", marks=slow),
        pytest.param("bicubic", "coreml", marks=slow), pytest.param("bilinear", "mlx", marks=slow),
    ],
)
def test_an_antialiased_resize_runs_on_every_backend_and_matches_eager(mode, backend):
    model = CameraResize(mode)
    result = compiler.compile(model, (FRAME,), backend, cache=False)
    captured = result.stages.capture.program
    assert not [n for n in captured.graph.nodes if n.target in ANTIALIASED]
    assert sum(n.target is torch.ops.aten.matmul.default for n in captured.graph.nodes) == 2
    assert "wrote 1 antialiased resize as matrix products" in result.report.format_stages()
    check = compiler.compare_with_eager(result, model, (FRAME,))
    assert check.passed, check.describe()


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("sizes", [((96, 96), (64, 64)), ((30, 50), (70, 20)), ((17, 9), (17, 4))])
def test_the_weights_are_torchs_kernel(mode, sizes):
    (in_h, in_w), (out_h, out_w) = sizes
    rows, columns = resize_weights(mode, (in_h, in_w), (out_h, out_w), False, None, None)
    x = torch.randn(2, 3, in_h, in_w, dtype=torch.float64)
    want = torch.nn.functional.interpolate(x, size=(out_h, out_w), mode=mode, antialias=True)
    assert (rows @ x @ columns - want).abs().max() < 1e-12


def test_a_uint8_resize_is_a_named_error_at_capture():
    class Uint8Resize(torch.nn.Module):
        def forward(self, frame):
            return torch.nn.functional.interpolate(frame, size=(64, 64), mode="bicubic", antialias=True)

    with pytest.raises(UserInputError, match=r"\[capture\] .*resizes a torch.uint8 tensor.*fixed point") as caught:
        compiler.compile(Uint8Resize(), (FRAME,), "portable", cache=False)
    assert "frame.float()" in caught.value.hint
