"""rms_norm adds its epsilon to the mean square of x, as torch does, on every backend.

Stock MLX 1.5.1 adds 1e-5 where torch's eps=None means the dtype's machine epsilon; coremltools
9.0 adds eps to the mean square of x divided by its row's largest |x| (eps * max|x|^2 in torch's
terms). Both agree with torch on rows of magnitude 1 and are far off on rows of magnitude 1e-3,
where the epsilon is a large share of the mean square: the cases are rows of each magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import compiler


class RMSNorm(torch.nn.Module):
    def __init__(self, eps) -> None:
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(torch.randn(8)), eps

    def forward(self, x):
        return F.rms_norm(x, (8,), self.weight, eps=self.eps)


# Magnitude varies fastest: the default run's sample (every 8th case) is 1e-3 on every backend.
@pytest.mark.parametrize("magnitude", [1e-3, 0.0, 1.0, 300.0])
@pytest.mark.parametrize("eps", [None, 1e-6], ids=["eps-default", "eps-1e-6"])
@pytest.mark.parametrize("backend", ["portable", "xnnpack", "coreml", "mlx"])
def test_rms_norm_matches_eager_at_every_magnitude(magnitude, eps, backend):
    torch.manual_seed(0)
    model, inputs = RMSNorm(eps).eval(), (torch.randn(3, 8) * magnitude,)
    result = compiler.compile(model, inputs, backend)
    check = compiler.compare_with_eager(result, model, inputs)
    assert check.passed, check.describe()
    if backend == "coreml":  # float16 by default: the float32 conversion must match too
        at_float32 = compiler.compile(model, inputs, backend, backend_options={"compute_precision": "float32"})
        check = compiler.compare_with_eager(at_float32, model, inputs)
        assert check.passed, check.describe()


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "coreml", "mlx"])
def test_a_negative_epsilon_is_subtracted_from_the_mean_square(backend):
    """torch takes any eps (OpInfo samples a negative one): x / sqrt(mean(x^2) + eps). Core ML's
    conversion scaled by sqrt(eps), NaN for a negative one."""
    torch.manual_seed(0)
    model, inputs = RMSNorm(-0.5).eval(), (torch.randn(3, 8) * 3,)
    options = {"compute_precision": "float32"} if backend == "coreml" else None
    result = compiler.compile(model, inputs, backend, backend_options=options)
    check = compiler.compare_with_eager(result, model, inputs)
    assert check.passed, check.describe()
