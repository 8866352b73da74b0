"""Complex values as real pairs: a rotary embedding written with `view_as_complex` (float32 and
float64) or with `torch.polar` compiles on every backend and agrees with eager. Without the
rewrite each failed on every backend (the Edge verifier refuses complex operands; `aten.polar`
is not Core ATen and its decomposition writes into a view, which torch's decomposition refuses)."""

import pytest
import torch

import compiler
from compiler.ir.errors import UserInputError

slow = pytest.mark.slow


class Rotary(torch.nn.Module):
    """Llama's rotary embedding: pairs of features as complex numbers times a complex table."""

    def __init__(self, dtype: torch.dtype, positions: int = 8, pairs: int = 4):
        super().__init__()
        self.dtype = dtype
        angles = torch.outer(torch.arange(positions, dtype=dtype), 1.0 / 10000 ** (torch.arange(pairs, dtype=dtype) / pairs))
        self.register_buffer("table", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x):
        z = torch.view_as_complex(x.to(self.dtype).reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(z * self.table).flatten(-2).to(x.dtype)


class PolarTable(torch.nn.Module):
    """A video model's rotary table built in forward with torch.polar, applied to features."""

    def forward(self, x, angles):
        table = torch.polar(torch.ones_like(angles), angles)
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        rotated = (z * table.unsqueeze(0)).conj() + z
        return torch.view_as_real(rotated).flatten(-2), table.abs(), torch.angle(table)


CASES = {
    "rotary32": lambda: (Rotary(torch.float32), (torch.randn(1, 8, 8),)),
    "rotary64": lambda: (Rotary(torch.float64), (torch.randn(1, 8, 8),)),
    "polar": lambda: (PolarTable(), (torch.randn(2, 6, 8), torch.rand(6, 4) * 3)),
}


@pytest.mark.parametrize(
    "case, backend",
    [
        ("rotary32", "xnnpack"), ("rotary64", "portable"), ("polar", "coreml"), ("polar", "mlx"),
        *(pytest.param(c, b, marks=slow) for c in CASES for b in ("portable", "xnnpack", "coreml", "mlx")
          if (c, b) not in {("rotary32", "xnnpack"), ("rotary64", "portable"), ("polar", "coreml"), ("polar", "mlx")}),
    ],
)
def test_complex_arithmetic_runs_on_every_backend_as_real_pairs(case, backend):
    model, inputs = CASES[case]()
    result = compiler.compile(model, inputs, backend, cache=False)
    captured = result.stages.capture.program
    assert not any(
        isinstance(v, torch.Tensor) and v.is_complex()
        for n in captured.graph.nodes for v in torch.utils._pytree.tree_leaves(n.meta.get("val"))
    )
    assert "as real pairs" in result.report.format_stages()
    check = compiler.compare_with_eager(result, model, inputs)
    assert check.passed, check.describe()


def test_a_complex_input_is_a_named_error():
    class Takes(torch.nn.Module):
        def forward(self, z):
            return torch.view_as_real(z * 2)

    with pytest.raises(UserInputError, match=r"\[capture\] the input z is complex"):
        compiler.compile(Takes(), (torch.randn(3, dtype=torch.complex64),), "portable", cache=False)


def test_a_complex_output_is_a_named_error():
    class Returns(torch.nn.Module):
        def forward(self, x):
            return torch.view_as_complex(x) * 2

    with pytest.raises(UserInputError, match=r"returns the complex tensor") as caught:
        compiler.compile(Returns(), (torch.randn(3, 2),), "portable", cache=False)
    assert "view_as_real" in caught.value.hint


def test_a_complex_op_without_a_formula_is_named():
    class Divides(torch.nn.Module):
        def forward(self, x, y):
            return torch.view_as_real(torch.view_as_complex(x) / torch.view_as_complex(y))

    with pytest.raises(UserInputError, match=r"the complex op aten.div.Tensor of div has no real-pair form"):
        compiler.compile(Divides(), (torch.randn(3, 2), torch.randn(3, 2)), "portable", cache=False)


class RealFFT(torch.nn.Module):
    def forward(self, x):
        return torch.fft.rfft(x), torch.fft.rfftn(x, dim=(0, 1))


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "coreml", "mlx"])
def test_a_real_fft_returned_as_it_is_is_computed_by_the_runtimes_kernel(backend):
    """Stock returns rfft's complex result from the runtime's `_fft_r2c` kernel; as a complex
    output of an op without a real-pair form, ours refused it. It stays as it is, on the CPU (the
    transform over the first dims permuted last for the kernel), and matches eager."""
    model, inputs = RealFFT(), (torch.randn(4, 6, 8),)
    artifact = compiler.compile(model, inputs, backend, cache=False)
    assert {p.op for p in artifact.program.plan.cpu_nodes} >= {"aten._fft_r2c.default"}
    for got, want in zip(compiler.run(artifact, inputs), model(*inputs), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
