"""`--check` of a quantized program: compared with the eager quantized model at a tolerance
derived from its activation quantizers' steps, the error against the float model reported as
the quantization error; a wrong program still fails."""

from __future__ import annotations

import copy

import pytest
import torch

import compiler
from compiler.cli.main import main
from compiler.ir.program_data import CONFIG_METHOD, ProgramData, flatbuffer_program
from compiler.models.examples import mlp
from compiler.running.tolerance import FLOAT32_ABSOLUTE

# (scheme, granularity) on XNNPACK: each PT2E and TorchAO flow, each granularity it takes.
SCHEMES = [
    ("int8_dynamic", None),
    ("int8_static", "per_channel"),
    pytest.param("int8_static", "per_tensor", marks=pytest.mark.slow),
    ("8da4w", "per_group"),
    pytest.param("8da4w", "per_channel", marks=pytest.mark.slow),
    ("8da8w", "per_channel"),
]


def _compiled(scheme, granularity, model=None, inputs=None):
    model, inputs = (model, inputs) if model is not None else mlp()
    options = {"quantize_granularity": granularity} if granularity else {}
    result = compiler.compile(model, inputs, "xnnpack", quantize=scheme, calibration=[inputs], cache=False, **options)
    return model, inputs, result


def _weights_and_scales(quantized: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, torch.fx.Node | None]:
    """The last Linear's integer weights and its scales (None for a per-tensor scale held
    in the graph: its dequantize node is returned instead)."""
    if isinstance(quantized, torch.fx.GraphModule):
        dequantize = [n for n in quantized.graph.nodes if "dequantize" in str(n.target) and n.args[0].op == "get_attr"][-1]
        weights = getattr(quantized, dequantize.args[0].target)
        if isinstance(dequantize.args[1], float):
            return weights, None, dequantize
        return weights, getattr(quantized, dequantize.args[1].target), None
    weight = quantized.layers[-1].weight
    return weight.qdata, weight.scale, None


def _wrong_program(quantized: torch.nn.Module, inputs, fault: str) -> bytes:
    """The quantized model with one fault in its last Linear, compiled for XNNPACK."""
    wrong = copy.deepcopy(quantized)
    weights, scales, dequantize = _weights_and_scales(wrong)
    if fault == "scale doubled":
        if dequantize is not None:
            dequantize.args = (dequantize.args[0], 2 * dequantize.args[1], *dequantize.args[2:])
            wrong.recompile()
        else:
            scales.mul_(2)
    else:  # one step off: every weight of the layer one integer step up
        top = 7 if weights.max() <= 7 and weights.min() >= -8 else 127
        weights.copy_((weights.to(torch.int32) + 1).clamp(max=top).to(weights.dtype))
    return compiler.compile(wrong, inputs, "xnnpack", cache=False).pte


@pytest.mark.parametrize("scheme, granularity", SCHEMES)
def test_a_quantized_program_is_checked_against_the_eager_quantized_model(scheme, granularity):
    model, inputs, result = _compiled(scheme, granularity)
    quantized = result.stages["quantize"].module
    check = compiler.compare_with_eager(result, model, inputs)
    assert check.passed, check.describe()
    assert check.reference == "the eager quantized model"
    with torch.no_grad():
        program, float_out = result.run(*inputs)[0], model(*inputs)
    assert check.quantization_error == pytest.approx((program - float_out).abs().max().item(), rel=1e-6)
    assert check.quantization_error > FLOAT32_ABSOLUTE  # against the float model, float32's tolerance fails
    assert "one step" in check.tolerance.rule and check.tolerance.absolute > FLOAT32_ABSOLUTE
    assert "quantization error" in check.describe()
    assert check.to_json()["quantization_error"] == check.quantization_error
    # Given the quantized model itself, the same tolerance, and no float model to report.
    same = compiler.compare_with_eager(result.pte, quantized, inputs)
    assert same.tolerance == check.tolerance and same.quantization_error is None

    wrong = compiler.compare_with_eager(_wrong_program(quantized, inputs, "scale doubled"), quantized, inputs)
    assert not wrong.passed, wrong.describe()


@pytest.mark.parametrize("granularity", ["per_group", "per_channel"])
def test_int4_weights_one_step_off_fail(granularity):
    model, inputs, result = _compiled("8da4w", granularity)
    quantized = result.stages["quantize"].module
    wrong = compiler.compare_with_eager(_wrong_program(quantized, inputs, "one step off"), quantized, inputs)
    assert not wrong.passed, wrong.describe()
    assert wrong.max_abs_error > 5 * wrong.tolerance.absolute


def test_a_weight_only_quantized_model_keeps_the_precision_tolerance():
    """No activation is quantized: the program computes in float32 with the dequantized weights."""
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.quant_api import IntxWeightOnlyConfig, quantize_

    model, inputs = mlp()
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    check = compiler.compare_with_eager(compiler.compile(model, inputs, "xnnpack", cache=False), model, inputs)
    assert check.passed and check.tolerance.absolute == FLOAT32_ABSOLUTE
    assert check.quantization_error is None and check.reference == "the eager model"


def test_the_cli_check_prints_the_quantization_error(capsys):
    from compiler.cli.main import main

    assert main(["compile", "mlp", "--backend", "xnnpack", "--quantize", "int8_dynamic", "--check", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "-> OK" in out and "quantization error" in out and "the eager quantized model" in out


def test_a_quantized_bfloat16_model_computing_in_float32_gets_its_activation_steps():
    """The reference of a bfloat16 model the precision stage computes in float32 is that stage's
    program, where TorchAO's per-token activation quantization is `quantize_affine` ops, not a weight's
    `activation_quantization`: its steps count too (a 0.5B bfloat16 Llama's 8da4w check failed at
    0.047 against 0.0079, the tolerance of a program that quantizes nothing)."""
    model, inputs = mlp()
    model = model.to(torch.bfloat16)
    _, _, result = _compiled("8da4w", "per_group", model, (inputs[0].to(torch.bfloat16),))
    check = compiler.compare_with_eager(result, model, (inputs[0].to(torch.bfloat16),))
    assert "activation quantizers' results moved one step" in check.tolerance.rule, check.tolerance.rule
    assert check.passed, check.describe()


def test_a_float16_program_over_its_requantization_tolerance_is_judged_at_float32():
    """ACT int8_static on Core ML: 0.446 against a float16 tolerance of 0.264 (269 requantizations),
    0.069 against 0.254 at float32. float16 rounding is named the cause, with both figures."""
    from compiler.running.runtime import CheckResult
    from compiler.running.tolerance import Tolerance

    one_step = Tolerance.for_precision("float16", 0.984, by_delegate=True).with_activation_steps(0.254, 269, (1e-7, 0.23), 4)
    at_float32 = CheckResult(0.0692, 1.0, 1, 0.984, Tolerance.for_precision("float32", 0.984).with_activation_steps(0.254, 269, (1e-7, 0.23), 4))
    judged = CheckResult(0.446, 1.0, 1, 0.984, one_step, at_float32=at_float32)
    assert judged.passed and judged.judged_at_float32
    text = judged.describe()
    assert "over its float16 tolerance" in text and "MISMATCH" not in text.splitlines()[0]
    assert "float16 rounding is the cause" in text and "0.446" in text and "0.0692" in text and "269 requantizations" in text
    # Without quantized activations, or with float32 failing too, float16's failure stands.
    plain = CheckResult(0.446, 1.0, 1, 0.984, Tolerance.for_precision("float16", 0.984, by_delegate=True), at_float32=at_float32)
    assert not plain.passed and "MISMATCH" in plain.describe()
    failing = CheckResult(0.446, 1.0, 1, 0.984, one_step, at_float32=CheckResult(0.5, 1.0, 1, 0.984, at_float32.tolerance))
    assert not failing.passed and not failing.judged_at_float32


def test_run_checks_a_quantized_program_as_its_compile_did(tmp_path, capsys):
    # `run` compared it with the float model (MISMATCH 0.907 on a Llama): the program now records the
    # configuration it was compiled with, and `run` quantizes the model again by it.
    program = tmp_path / "mlp.pte"
    assert main(["compile", "mlp", "--backend", "xnnpack", "--quantize", "8da4w", "--check", "--no-cache",
                 "-o", str(program)]) == 0
    compiled = capsys.readouterr().out.splitlines()[-1]
    assert compiled.startswith("check against the eager quantized model:")
    assert main(["run", str(program), "mlp"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == compiled
    methods = {plan.name for plan in flatbuffer_program(ProgramData(path=str(program))).execution_plan}
    assert methods == {"forward", CONFIG_METHOD}


def test_run_calibrates_a_static_scheme_as_its_compile_did(tmp_path, capsys):
    program = tmp_path / "mlp.pte"
    assert main(["compile", "mlp", "--backend", "xnnpack", "--quantize", "int8_static", "--calibration-draws", "2",
                 "--check", "--no-cache", "-o", str(program)]) == 0
    compiled = capsys.readouterr().out.splitlines()[-1]
    assert main(["run", str(program), "mlp", "--calibration-draws", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == compiled
    assert main(["run", str(program), "mlp"]) == 2  # a static scheme needs its calibration inputs
    assert "is static" in capsys.readouterr().err
