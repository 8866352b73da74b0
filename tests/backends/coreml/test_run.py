"""`compiler.run` runs Core ML programs here: CPU kernels with torch, each Core ML payload
in the MIL reference interpreter, bound the way ExecuTorch's Core ML delegate binds it.

Programs built elsewhere run too (by path or bytes): a stock-ExecuTorch program shows
the error stock's conversion makes.
"""

import coremltools as ct
import pytest
import torch
import torch.nn as nn
from executorch.backends.apple.coreml.compiler import CoreMLBackend

import compiler
from compiler.cli import main as cli
from compiler.backends.coreml.reference import AliasedPayloadOutput
from compiler.ir.errors import UserInputError
from compiler.running.runtime import LoadedProgram, compare_with_eager
from compiler.running.tolerance import FLOAT32_ABSOLUTE
from coreml_helpers import compile_coreml, cpu_ops, stock_pte

FP32 = [CoreMLBackend.generate_compute_precision_compile_spec(ct.precision.FLOAT32)]


class TanhGelu(nn.Module):
    def forward(self, x):
        return nn.functional.gelu(x, approximate="tanh")


@pytest.fixture(scope="module")
def gelu_case():
    torch.manual_seed(0)
    return TanhGelu(), (torch.linspace(-6, 6, 512).reshape(8, 64),)


def test_stock_tanh_gelu_program_shows_stock_error(gelu_case, tmp_path):
    model, inputs = gelu_case
    path = tmp_path / "stock_gelu.pte"
    path.write_bytes(stock_pte(model, inputs, compile_specs=FP32))
    check = compare_with_eager(str(path), model, inputs)
    # Stock converts the exact GELU: off by tanh GELU's distance from it, 4.7e-4 at most.
    assert 4.5e-4 < check.max_abs_error < 4.8e-4
    assert not check.passed and check.tolerance.absolute == FLOAT32_ABSOLUTE

    ours = compare_with_eager(compile_coreml(model, inputs, compile_specs=FP32), model, inputs)
    assert ours.passed and ours.max_abs_error < 1e-6


def test_run_command_checks_a_pte_built_elsewhere(gelu_case, tmp_path, capsys):
    model, inputs = gelu_case
    factory = tmp_path / "gelu_model.py"
    factory.write_text(
        "import torch\n"
        "def make():\n"
        "    model = torch.nn.GELU(approximate='tanh')\n"
        "    return model, (torch.linspace(-6, 6, 512).reshape(8, 64),)\n"
    )
    path = tmp_path / "stock.pte"
    path.write_bytes(stock_pte(nn.GELU(approximate="tanh"), inputs, compile_specs=FP32))
    assert cli.main(["run", str(path), f"{factory}:make"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "absolute, for a program computing in float32" in out


class Accumulate(nn.Module):
    """A buffer Core ML keeps as state (iOS 18): each call adds to it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(2, 8))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 3.0


def test_core_ml_state_carries_between_runs():
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    artifact = compile_coreml(Accumulate(), (x,), minimum_deployment_target="iOS18", compile_specs=FP32)
    program, eager = LoadedProgram(artifact), Accumulate()
    for _ in range(3):
        (got,) = program((x,))
        torch.testing.assert_close(got, eager(x), rtol=0, atol=1e-2)  # Core ML state is float16
    assert eager.total.abs().max() > 1  # three different values were compared
    (fresh,) = LoadedProgram(artifact)((x,))  # a new load starts from zero, as MLModel.newState
    torch.testing.assert_close(fresh, x * 3.0, rtol=0, atol=1e-2)


class Mixed(nn.Module):
    def forward(self, x):
        y = torch.cumsum(x.sin(), dim=-1)  # kept on the CPU below
        return (y * 2).softmax(-1) + x


def test_program_with_cpu_kernels_between_core_ml_delegates():
    torch.manual_seed(0)
    model, inputs = Mixed(), (torch.randn(4, 16),)
    artifact = compile_coreml(model, inputs, compile_specs=FP32, skip_ops_for_coreml_delegation=["aten.cumsum.default"])
    assert "aten.cumsum.default" in cpu_ops(artifact).values() and len(artifact.program.delegates) == 2
    check = compare_with_eager(artifact, model, inputs)
    assert check.passed and check.max_abs_error < 1e-5


def test_float16_program_is_checked_with_a_relative_tolerance():
    torch.manual_seed(0)
    model, inputs = Mixed(), (torch.randn(4, 16) * 10,)
    check = compare_with_eager(compile_coreml(model, inputs), model, inputs)
    assert check.passed and check.max_abs_error > 1e-3  # float16 really ran
    assert check.tolerance.absolute == pytest.approx(1e-2 * check.largest_expected)
    assert "relative" in check.tolerance.rule and "float16" in check.tolerance.rule


class ReturnsItsInput(nn.Module):
    def forward(self, x):
        return x.clone(), x + 1


def test_payload_returning_its_input_is_refused_by_name():
    x = torch.randn(3)
    with pytest.raises(AliasedPayloadOutput) as err:
        compiler.run(stock_pte(ReturnsItsInput(), (x,)), (x,))
    assert "output 'x' is also an input of the model" in str(err.value)
    # Ours gives the output its own value: it runs.
    outputs = compiler.run(compile_coreml(ReturnsItsInput(), (x,), compile_specs=FP32), (x,))
    torch.testing.assert_close(outputs[0], x)


def test_what_is_not_a_program_is_a_user_error(tmp_path):
    with pytest.raises(UserInputError, match="no program file"):
        compiler.run(str(tmp_path / "missing.pte"), (torch.ones(1),))
    with pytest.raises(UserInputError, match="not an ExecuTorch program"):
        compiler.run(b"not a program at all", (torch.ones(1),))


def test_compile_check_runs_core_ml_and_says_its_tolerance(capsys):
    assert cli.main(["compile", "mlp", "--backend", "coreml", "--check"]) == 0
    out = capsys.readouterr().out
    assert "-> OK (tolerance" in out and "for a delegate computing in float16" in out


class ZeroDimOutput(nn.Module):
    def forward(self, x):
        return x.unbind(0)[1] * 2  # a 0-d tensor: Core ML outputs have rank >= 1


def test_zero_dim_output_keeps_the_programs_shape():
    x = torch.randn(2)
    (got,) = compiler.run(compile_coreml(ZeroDimOutput(), (x,), compile_specs=FP32), (x,))
    assert got.shape == () and torch.allclose(got, x[1] * 2)


class ScaledByZeroDim(nn.Module):
    def forward(self, x, scale):
        return x * scale  # `scale` is 0-d: coremltools declares the input rank 1


def test_zero_dim_input_is_bound_to_the_rank_one_input_core_ml_declares():
    model, inputs = ScaledByZeroDim(), (torch.randn(3, 4), torch.tensor(1.5))
    check = compare_with_eager(compile_coreml(model, inputs, compute_precision="float32"), model, inputs)
    assert check.passed and check.max_abs_error < 1e-6


def test_delegate_output_of_another_size_is_a_named_error(monkeypatch):
    from compiler.backends.coreml.reference import CoreMLDelegate
    from compiler.running.reference import ReferenceExecutionError

    x = torch.randn(2, 4)
    artifact = compile_coreml(nn.Linear(4, 3), (x,), compute_precision="float32")
    # As a conversion fault would (a ceil-mode pool whose last window starts past the input).
    monkeypatch.setattr(CoreMLDelegate, "execute", lambda self, inputs: [torch.zeros(2, 5)])
    with pytest.raises(ReferenceExecutionError, match=r"returned shape \(2, 5\).*fixed at \(2, 3\)"):
        compiler.run(artifact, (x,))
