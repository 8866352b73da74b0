"""The quantize stage: named schemes per backend, calibration, and what it records."""

from __future__ import annotations

import json

import pytest
import torch

import compiler
from compiler.cli.main import main
from compiler.driver.instruments import Instrument
from compiler.models.examples import draw_inputs, mlp
from compiler.running.runtime import LoadedProgram
from compiler.ir.targets import PORTABLE_ANSWER


class StagesRun(Instrument):
    def __init__(self) -> None:
        self.ran: list[str] = []

    def before_stage(self, stage, artifact):
        self.ran.append(stage)


@pytest.fixture(scope="module")
def model():
    return mlp(features=32, hidden=64, layers=2, batch=4)[:2]


def test_a_static_scheme_without_calibration_fails_before_any_stage(model):
    stages = StagesRun()
    with pytest.raises(compiler.UserInputError) as err:
        compiler.compile(*model, "xnnpack", quantize="int8_static", instruments=[stages])
    assert err.value.stage == "quantize" and "calibration" in str(err.value) and "calibration=" in err.value.hint
    assert stages.ran == []


@pytest.mark.parametrize(
    "backend, options, says",
    [
        ("coreml", {"quantize": "int8_dynamic"}, "for coreml use one of: int8_static, int8_weight, 4w, 8w, codebook"),
        ("xnnpack", {"quantize": "int8_dynamic", "quantize_granularity": "per_group"}, "takes granularity per_channel"),
        ("portable", {"quantize": "8da4w"}, PORTABLE_ANSWER),
        # With a scheme too: the fuzzer's quantize axis reached partition's kernel check with it.
        ("portable", {"quantize": "int8_dynamic", "quantize_embedding": "4w"}, "quantize_embedding on portable"),
        ("xnnpack", {"quantize": "8da4w", "quantize_group_size": 16}, "group sizes that are a multiple of 32"),
    ],
)
def test_a_scheme_the_backend_does_not_take_is_named(model, backend, options, says):
    with pytest.raises(compiler.UserInputError) as err:
        compiler.compile(*model, backend, **options)
    assert err.value.stage == "quantize"
    assert says in f"{err.value} {err.value.hint}"


def test_an_unknown_scheme_is_named_with_the_known_ones(model):
    with pytest.raises(compiler.UserInputError) as err:
        compiler.compile(*model, "xnnpack", quantize="int3")
    assert "int3" in str(err.value) and "8da4w" in err.value.hint


def test_torchao_quantizes_a_copy_and_leaves_the_users_model_alone(model):
    module, inputs = model
    before = {name: (t, t.clone()) for name, t in module.named_parameters()}
    result = compiler.compile(module, inputs, "xnnpack", quantize="8da4w", quantize_group_size=64)
    after = dict(module.named_parameters())
    assert all(after[name] is t and torch.equal(t, copy) for name, (t, copy) in before.items())
    quantized = result.stages["quantize"].module
    assert quantized is not module and result.stages["quantize"].float_module is module
    row = next(r for r in result.report.stages if r.stage == "quantize")
    # The first layer's 32 input features do not split into groups of 64: it stays in float, and says why.
    assert row.metrics == {
        "scheme": "8da4w", "granularity": "per_group", "group_size": 64,
        "left_in_float": "layers.0: 32 input features are not a multiple of the group size 64",
    }
    # The eager quantized model computes something else than the float model.
    with torch.no_grad():
        assert not torch.allclose(quantized(*inputs), module(*inputs), atol=1e-4)


def test_int8_static_on_xnnpack_is_delegated_whole_and_matches_the_eager_quantized_model(model):
    module, inputs = model
    calibration = draw_inputs("mlp:features=32,hidden=64,layers=2,batch=4", 4)
    result = compiler.compile(module, inputs, "xnnpack", quantize="int8_static", calibration=calibration)
    assert not result.report.plan.cpu_nodes
    got = LoadedProgram(result)(inputs)[0]
    with torch.no_grad():
        want = result.stages["quantize"].module(*inputs)
    assert (got - want).abs().max().item() <= 1e-5  # integer arithmetic on both sides
    captured = {str(n.target) for n in result.stages["capture"].program.graph.nodes}
    assert "quantized_decomposed.quantize_per_tensor.default" in captured


@pytest.mark.parametrize("scheme", ["int8_dynamic", "int8_static"])
def test_pt2e_int8_runs_on_the_portable_runtime_with_its_quantized_kernels(model, scheme):
    # The wheel's quantized kernels are loaded into the runtime: stock programs fail to load with
    # "Missing operator quantized_decomposed::dequantize_per_tensor.Tensor_out".
    module, inputs = model
    result = compiler.compile(module, inputs, "portable", quantize=scheme, calibration=[inputs])
    assert any(op.startswith("quantized_decomposed::") for op in result.program.operators)
    got = LoadedProgram(result)(inputs)[0]
    with torch.no_grad():
        want = result.stages["quantize"].module(*inputs)
    assert (got - want).abs().max().item() <= 1e-5


def test_calibration_changes_a_static_program_and_the_options_are_recorded(model, tmp_path):
    module, inputs = model
    small = [(inputs[0] * 0.1,)]
    large = [(inputs[0] * 10.0,)]
    a = compiler.compile(module, inputs, "xnnpack", quantize="int8_static", calibration=small, dump_dir=tmp_path / "a")
    b = compiler.compile(module, inputs, "xnnpack", quantize="int8_static", calibration=large)
    assert a.pte != b.pte
    assert a.config.to_json()["stages"]["quantize"]["scheme"] == "int8_static"
    # The capture stage file records the configuration; resuming from it emits the same program.
    resumed = compiler.compile(None, resume_from=tmp_path / "a" / "02-capture.stage")
    assert resumed.pte == a.pte
    assert resumed.config.quantize.scheme == "int8_static"


def test_the_stage_cache_keys_on_the_quantized_program(model, tmp_path):
    module, inputs = model
    cache = str(tmp_path / "cache")
    first = compiler.compile(module, inputs, "xnnpack", quantize="8da4w", cache_dir=cache)
    again = compiler.compile(module, inputs, "xnnpack", quantize="8da4w", cache_dir=cache)
    other = compiler.compile(module, inputs, "xnnpack", quantize="8da4w", quantize_granularity="per_channel", cache_dir=cache)
    cached = lambda r: [row.stage for row in r.report.stages if row.cached]  # noqa: E731
    assert cached(first) == [] and "lower" in cached(again) and cached(other) == []
    assert again.pte == first.pte != other.pte


@pytest.mark.slow  # two CLI compiles; the API calibration tests above run by default
def test_the_cli_quantizes_with_draws_and_with_a_calibration_file(tmp_path, capsys):
    spec = "mlp:features=16,hidden=32,layers=2"
    saved = tmp_path / "calibration.pt"
    torch.save(list(draw_inputs(spec, 2)), saved)
    report = tmp_path / "r.json"
    assert main(["compile", spec, "--backend", "xnnpack", "--quantize", "int8_static", "--calibration", str(saved),
                 "--no-cache", "--report-json", str(report)]) == 0
    config = json.loads(report.read_text())["config"]
    assert config["stages"]["quantize"]["scheme"] == "int8_static"
    assert main(["compile", spec, "--backend", "xnnpack", "--quantize", "int8_static", "--calibration-draws", "2",
                 "--no-cache"]) == 0
    assert main(["compile", spec, "--backend", "xnnpack", "--quantize", "int8_static", "--no-cache"]) == 2
    err = capsys.readouterr().err
    assert "[quantize]" in err and "--calibration-draws" in err


def test_draws_come_from_a_factory_without_a_seed_keyword_and_a_repeated_draw_is_named(tmp_path):
    """Users write `def make(): return model, (torch.randn(...),)`: each draw seeds the global
    generators (and leaves them as they were); a factory whose inputs never change is an error."""
    path = tmp_path / "factories.py"
    path.write_text(
        "import torch\n"
        "def make():\n    return torch.nn.Linear(4, 4), (torch.randn(1, 4),)\n"
        "def fixed():\n    return torch.nn.Linear(4, 4), (torch.ones(1, 4),)\n"
    )
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first, second = draw_inputs(f"{path}:make", 2)
    assert not torch.equal(first[0], second[0])
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(draw_inputs(f"{path}:make", 2), (first, second)))
    with pytest.raises(compiler.UserInputError, match="same inputs for draws 1 and 2") as err:
        draw_inputs(f"{path}:fixed", 3)
    assert err.value.stage == "quantize" and "--calibration FILE" in err.value.hint
    first, second = draw_inputs("mlp", 2)
    assert not torch.equal(first[0], second[0])


def test_a_resumed_quantized_compile_is_checked_against_the_eager_quantized_model(tmp_path, capsys):
    spec = "mlp:features=32,hidden=64,layers=2"
    assert main(["compile", spec, "--backend", "xnnpack", "--quantize", "8da4w", "--stop-after", "capture",
                 "-o", str(tmp_path / "c.stage"), "--no-cache"]) == 0
    capsys.readouterr()
    assert main(["compile", spec, "--resume-from", str(tmp_path / "c.stage"), "--check", "--no-cache"]) == 0
    out = capsys.readouterr().out
    assert "check against the eager quantized model" in out and "quantization error" in out


def test_mlx_weights_are_those_of_mlx_own_llm_export(model):
    """MLX's export picks scales by HQQ (`extension/llm/export/quantize.py`): ours the same."""
    import copy

    from executorch.extension.llm.export.quantize import quantize_model_

    module, inputs = model
    result = compiler.compile(module, inputs, "mlx", quantize="4w", quantize_group_size=32, stop_after="quantize")
    theirs = copy.deepcopy(module)
    quantize_model_(theirs, qlinear_config="4w", qlinear_group_size=32)
    with torch.no_grad():
        assert torch.equal(result.artifact.module(*inputs), theirs(*inputs))


class EmbedThenLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(50, 64)
        self.head = torch.nn.Linear(64, 8)

    def forward(self, ids):
        return self.head(self.table(ids))


@pytest.mark.parametrize(
    "layer, inputs, options, why",
    [
        # Each failed inside ExecuTorch or TorchAO (IndexError, AssertionError, RuntimeError).
        (torch.nn.Linear(32, 2), (torch.randn(32),), {"quantize": "8da4w", "quantize_granularity": "per_channel"},
         "its input is 1-D"),
        (torch.nn.Linear(4, 4), (torch.randn(2, 4),), {"quantize": "8da4w", "quantize_granularity": "per_channel"},
         "XNNPACK's 4-bit kernels take rows of a multiple of 32"),
        (torch.nn.Linear(1, 3, bias=False), (torch.randn(2, 1),),
         {"quantize": "8da8w", "quantize_granularity": "per_channel"}, "cannot pack a single column"),
    ],
)
def test_a_layer_a_scheme_cannot_take_stays_in_float_and_says_why(layer, inputs, options, why):
    result = compiler.compile(layer.eval(), inputs, "xnnpack", **options)
    row = next(r for r in result.report.stages if r.stage == "quantize")
    assert why in row.metrics["left_in_float"]
    torch.testing.assert_close(LoadedProgram(result)(inputs)[0], layer(*inputs), atol=1e-4, rtol=1e-4)


def test_embedding_quantization_goes_with_a_pt2e_scheme():
    # The converted PT2E graph has no Embedding modules: the table was silently left in float.
    torch.manual_seed(0)
    model, ids = EmbedThenLinear().eval(), (torch.randint(0, 50, (2, 5)),)
    result = compiler.compile(model, ids, "xnnpack", quantize="int8_dynamic", quantize_embedding="8w")
    captured = {str(n.target) for n in result.stages["capture"].program.graph.nodes}
    assert "torchao.dequantize_affine.default" in captured
    assert "quantized_decomposed.choose_qparams.tensor" in captured


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(64, 4, batch_first=True)
        self.head = torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.head(self.attention(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("backend, scheme", [("xnnpack", "8da4w"), ("mlx", "4w")])
def test_multihead_attentions_output_projection_stays_in_float(backend, scheme):
    # LeRobot's ACT: MultiheadAttention calls its out_proj's weight itself, which TorchAO's
    # quantized weight refuses ("IntxUnpackedToInt8Tensor dispatch: ... aten.t").
    torch.manual_seed(0)
    model, inputs = Attention().eval(), (torch.randn(1, 8, 64),)
    result = compiler.compile(model, inputs, backend, quantize=scheme)
    row = next(r for r in result.report.stages if r.stage == "quantize")
    assert row.metrics["left_in_float"].startswith("attention.out_proj: nn.MultiheadAttention's output projection")


class TiedLM(torch.nn.Module):
    """A table read twice: by the embedding and, transposed, by the lm_head (GPT-2, Llama 3.2)."""

    def __init__(self, vocab: int = 256, dim: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.positions = torch.nn.Embedding(16, dim)  # not tied: stays in float unless asked
        self.mix = torch.nn.Linear(dim, dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(torch.relu(self.mix(self.embed(ids) + self.positions.weight[: ids.shape[-1]])))


@pytest.mark.parametrize("backend, scheme", [("xnnpack", "8da4w"), ("coreml", "8w"), ("mlx", "4w")])
def test_a_tied_table_is_quantized_with_the_lm_head_it_is_tied_to(backend, scheme):
    # Left in float, GPT-2 small's 154 MB table stayed beside its 4-bit codes: 0.36x the float program.
    torch.manual_seed(0)
    model, ids = TiedLM().eval(), (torch.randint(0, 256, (1, 8)),)
    plain = compiler.compile(model, ids, backend, quantize=scheme, quantize_embedding="4w" if scheme == "8da4w" else "8w",
                             cache=False)
    result = compiler.compile(model, ids, backend, quantize=scheme, cache=False)
    row = next(r for r in result.report.stages if r.stage == "quantize")
    assert row.metrics["embedding"] == f"{scheme[-2:]} (tied to a quantized Linear)"
    table = model.embed.weight.numel() * 4
    assert len(result.pte) < table, (len(result.pte), table)
    assert "left_in_float" not in row.metrics  # the untied positions table is not the scheme's to take
    # Asked for every table, the stage names the one the model reads as a tensor (it failed in TorchAO).
    asked = next(r for r in plain.report.stages if r.stage == "quantize").metrics
    assert asked["left_in_float"] == "positions: the example inputs never call it (the model reads its weight " \
        "itself, if at all): a quantized weight cannot be read so"
    check = compiler.compare_with_eager(result, model, ids)
    assert check.passed, check.describe()
    assert model.lm_head.weight is model.embed.weight  # the user's model keeps its tie


def test_portable_keeps_a_tied_table_in_float():
    torch.manual_seed(0)
    model, ids = TiedLM().eval(), (torch.randint(0, 256, (1, 8)),)
    result = compiler.compile(model, ids, "portable", quantize="int8_dynamic", cache=False)
    row = next(r for r in result.report.stages if r.stage == "quantize")
    assert "embedding" not in row.metrics
    assert compiler.compare_with_eager(result, model, ids).passed


class ReadsAWeight(torch.nn.Module):
    """A Linear whose weight the model reads itself (as ACT's transformer reads some), and one it calls."""

    def __init__(self) -> None:
        super().__init__()
        self.read, self.called = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.called(x @ self.read.weight.unsqueeze(0).transpose(1, 2))


def test_a_linear_the_model_never_calls_stays_in_float_and_says_why():
    # ACT's codebook compile failed at capture: TorchAO's quantized weight refuses `unsqueeze`.
    torch.manual_seed(0)
    model, inputs = ReadsAWeight().eval(), (torch.randn(1, 4, 64),)
    result = compiler.compile(model, inputs, "mlx", quantize="4w", cache=False)
    row = next(r for r in result.report.stages if r.stage == "quantize")
    assert row.metrics["left_in_float"].startswith("read: the example inputs never call it")
    assert compiler.compare_with_eager(result, model, inputs).passed
