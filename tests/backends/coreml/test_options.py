"""CoreMLPartitioner's options carry over; lower_full_graph; keep-whole and the CPU-kernel verifier."""

import pytest
import torch
import torch.nn as nn

import compiler
from compiler.backends.base import KeepWhole
from compiler.backends.coreml import CoreMLBackend, CoreMLRefusal
from compiler.ir.errors import UserInputError, VerificationError
from coreml_helpers import compile_coreml, cpu_ops, cpu_reasons, stock_error


class BroadcastIndices(nn.Module):
    def forward(self, y, v):
        y = y.clone()
        y[torch.tensor([[0], [2]]), torch.tensor([1, 3, 4])] = v  # (2, 1) and (3,) broadcast to (2, 3)
        return y * 2


def test_lower_full_graph_fails_with_the_reason():
    # Stock fails inside coremltools, without naming the op or the option.
    inputs = (torch.randn(4, 5), torch.randn(2, 3))
    stock = stock_error(BroadcastIndices(), inputs, lower_full_graph=True)
    assert "has shape (3,), others have (2, 1)" in stock
    with pytest.raises(CoreMLRefusal) as err:
        compile_coreml(BroadcastIndices(), inputs, lower_full_graph=True)
    text = str(err.value)
    assert "aten.index_put.default with index tensors that broadcast against each other" in text
    assert "run them on the CPU, or rewrite the model to avoid them (lower_full_graph=False)" in text
    assert "aten_index_put_default" in err.value.nodes
    assert err.value.stage == "partition"


class AddCumsum(nn.Module):
    def forward(self, x):
        return torch.cumsum(x + 1, -1) * 2


@pytest.mark.parametrize("spelling", ["aten.cumsum.default", "aten::cumsum.default", "aten.cumsum", "edge.aten.cumsum.default"])
def test_skip_ops_in_aten_and_edge_spelling(spelling):
    artifact = compile_coreml(AddCumsum(), (torch.randn(2, 4),), skip_ops_for_coreml_delegation=[spelling])
    assert list(cpu_ops(artifact).values()) == ["aten.cumsum.default"]
    assert "skip_ops_for_coreml_delegation" in next(iter(cpu_reasons(artifact).values()))


def test_deployment_target_goes_into_compile_specs():
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend as EtCoreML

    backend = CoreMLBackend(minimum_deployment_target="iOS18")
    assert EtCoreML.min_deployment_target_from_compile_specs(backend.compile_specs) == ct.target.iOS18
    specs = EtCoreML.generate_compile_specs(minimum_deployment_target=ct.target.iOS17)
    assert CoreMLBackend(compile_specs=specs).delegation_spec.compile_specs == specs
    with pytest.raises(UserInputError):
        CoreMLBackend(compile_specs=specs, minimum_deployment_target="iOS18")
    with pytest.raises(UserInputError):
        CoreMLBackend(minimum_deployment_target="iOS99")


def test_bad_option_combinations_are_user_errors():
    with pytest.raises(UserInputError):
        CoreMLBackend(lower_full_graph=True, skip_ops_for_coreml_delegation=["aten.add.Tensor"])
    with pytest.raises(UserInputError):
        compiler.compile(AddCumsum(), (torch.randn(2, 4),), "coreml", backend_options={"no_such": 1})


class Uint8Matmul(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b).float() * 2


class StockKeepWhole(CoreMLBackend):
    """Keeps whole what stock keeps whole, without our filter, and like stock decides it
    before partitioning (it tells the dry run there is nothing to check)."""

    def keep_whole(self, program):
        return KeepWhole(super().keep_whole(program).ops)

    def dry_run_needed(self, program, kept):
        return None


def test_kept_whole_op_landing_on_cpu_is_caught_at_compile_time():
    inputs = (torch.randint(0, 9, (2, 3), dtype=torch.uint8), torch.randint(0, 9, (3, 2), dtype=torch.uint8))
    with pytest.raises(VerificationError) as err:
        compiler.compile(Uint8Matmul(), inputs, StockKeepWhole())
    assert err.value.invariant == "cpu_ops_have_kernels"
    assert "aten::matmul.out" in str(err.value)
    # Ours keeps matmul whole only where Core ML will take it, so it decomposes here.
    artifact = compile_coreml(Uint8Matmul(), inputs)
    assert "aten.mul.Tensor" not in cpu_ops(artifact).values()


def test_cli_prints_per_op_placement(tmp_path, capsys):
    from compiler.cli.main import main

    source = tmp_path / "m.py"
    source.write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return (x > 0).amax(-1).float() + x.sum(-1)\n"
        "def make():\n"
        "    return M(), (torch.randn(2, 4),)\n"
    )
    assert main(["compile", f"{source}:make", "--backend", "coreml", "-o", str(tmp_path / "m.pte")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if " aten.amax.default " in line)
    assert "CPU (portable kernel)" in row and "over bool" in row
    assert any(" aten.gt.Scalar " in line and "Core ML delegate 1" in line for line in out.splitlines())


def test_compute_precision_option_sets_the_compile_spec(capsys):
    from compiler.cli import main as cli
    from compiler.backends.coreml.interpreter import load_programs, MilInterpreter

    model, inputs = nn.Linear(4, 4), (torch.randn(2, 4),)
    float32 = compile_coreml(model, inputs, compute_precision="float32")
    float16 = compile_coreml(model, inputs)
    assert not MilInterpreter(load_programs(float32.pte)[0]).computes_in_float16
    assert MilInterpreter(load_programs(float16.pte)[0]).computes_in_float16
    assert cli.main(["compile", "mlp", "--backend", "coreml", "--backend-option", "compute_precision=float32",
                     "--check"]) == 0
    assert "absolute, for a program computing in float32" in capsys.readouterr().out


def test_compute_precision_option_errors_name_the_option():
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend as Stock

    with pytest.raises(UserInputError, match="'double' is not a Core ML compute precision"):
        CoreMLBackend(compute_precision="double")
    fp16 = [Stock.generate_compute_precision_compile_spec(ct.precision.FLOAT16)]
    with pytest.raises(UserInputError, match="compute_precision=FLOAT32 disagrees with the one in compile_specs"):
        CoreMLBackend(compile_specs=fp16, compute_precision="float32")
