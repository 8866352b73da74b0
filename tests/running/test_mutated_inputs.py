"""A model that writes into an input gives the user its outputs and leaves the input written, as eager
does. ExecuTorch writes the input back and returns its new value as a method output ahead of the
model's own (stock returns both); run and the check returned and counted two outputs: "the program
returned 2 outputs, eager returned 1"."""

import pytest
import torch

import compiler


class WritesNoise(torch.nn.Module):
    """A world-model policy's conditioning written into the first noise frame."""

    def forward(self, cond, noise):
        noise[:, 0:1] = cond
        return noise * 2


class CopiesNoise(torch.nn.Module):
    """WritesNoise's outputs without its write."""

    def forward(self, cond, noise):
        noise = noise.clone()
        noise[:, 0:1] = cond
        return noise * 2


class BatchNormWithStatistics(torch.nn.Module):
    """Training-mode batch norm whose running statistics are inputs it updates in place."""

    def forward(self, x, running_mean, running_var):
        return torch.ops.aten._native_batch_norm_legit(x, None, None, running_mean, running_var, True, 0.1, 1e-5)


def _noise_inputs():
    return torch.randn(2, 1, 3), torch.randn(2, 4, 3)


BACKENDS = ["portable", "xnnpack", "coreml", "mlx"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_returns_the_models_outputs_and_writes_the_input_as_eager_does(backend):
    result = compiler.compile(WritesNoise(), _noise_inputs(), backend, cache=False)
    cond, noise = _noise_inputs()
    eager_noise = noise.clone()
    want = WritesNoise()(cond, eager_noise)
    (got,) = compiler.run(result, (cond, noise))
    tolerance = 2e-3 if backend == "coreml" else 1e-6  # Core ML computes in float16
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(noise, eager_noise, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_check_passes_a_model_writing_its_inputs_and_leaves_the_callers_inputs_alone(backend):
    result = compiler.compile(BatchNormWithStatistics(), _statistics(), backend, cache=False)
    inputs = _statistics()
    given = [t.clone() for t in inputs]
    check = compiler.compare_with_eager(result, BatchNormWithStatistics(), inputs)
    assert check.passed and check.outputs == 3, check.describe()
    assert all(torch.equal(a, b) for a, b in zip(inputs, given))


def _statistics():
    return torch.randn(2, 3, 5), torch.zeros(3), torch.ones(3)


def test_a_program_that_does_not_write_the_input_fails_the_check():
    """Same outputs, but the caller's noise is left as it was where eager writes it."""
    result = compiler.compile(CopiesNoise(), _noise_inputs(), "portable", cache=False)
    check = compiler.compare_with_eager(result, WritesNoise(), _noise_inputs())
    assert not check.passed


class ZeroesMaskedColumns(torch.nn.Module):
    """A bool mask written by positions, then the input's masked columns zeroed in place."""

    def forward(self, a):
        mask = torch.zeros(8, dtype=torch.bool)
        mask[[0, 1, 2, 3, 4, 5]] = True
        a[:, mask] *= 0
        return a * 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_masked_write_into_the_input_runs_as_eager(backend):
    result = compiler.compile(ZeroesMaskedColumns(), (torch.randn(1, 8, 3),), backend, cache=False)
    check = compiler.compare_with_eager(result, ZeroesMaskedColumns(), (torch.randn(1, 8, 3),))
    assert check.passed, check.describe()


class NativeBatchNormWithStatistics(torch.nn.Module):
    """`native_batch_norm` updates its running statistics without declaring it in its schema:
    functionalized, their new values took the places of its first two outputs (OpInfo's case)."""

    def forward(self, x, running_mean, running_var, weight, bias):
        return torch.native_batch_norm(x, weight, bias, running_mean, running_var, True, 0.1, 1e-5)


def _statistics_and_affine():
    return torch.randn(2, 3, 5), torch.zeros(3), torch.ones(3), torch.randn(3), torch.randn(3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_native_batch_norm_returns_its_outputs_and_writes_its_running_statistics(backend):
    result = compiler.compile(NativeBatchNormWithStatistics(), _statistics_and_affine(), backend, cache=False)
    check = compiler.compare_with_eager(result, NativeBatchNormWithStatistics(), _statistics_and_affine())
    assert check.passed and check.outputs == 3, check.describe()
