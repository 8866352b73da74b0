"""A stage file replays the run that wrote it: the same configuration, the same stages, the
same program, from the file alone (API and CLI)."""

import inspect
import json

import pytest
import torch

import compiler
from compiler.backends.coreml.payload import read_models
from compiler.cli.main import main
from compiler.driver.config import STAGE_NAMES, dependency_versions
from compiler.models.examples import EXAMPLES
from compiler.ir.private_api import deserialize_pte


class DecoderStep(torch.nn.Module):
    """A step that writes a KV-cache-like buffer (Core ML state from iOS 18) and reads it back."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(4, 8))

    def forward(self, x, position):
        self.cache.index_copy_(0, position, self.proj(x))
        return torch.softmax(self.cache @ x.T, dim=0).T @ self.cache


def decoder_step():
    torch.manual_seed(0)  # the CLI test builds it twice; the payloads' weights must agree
    return DecoderStep().eval(), (torch.randn(1, 8), torch.tensor([1]))


IOS18 = {"minimum_deployment_target": "iOS18"}


def program_without_payloads(pte: bytes):
    """The `.pte`'s program with the delegate payloads taken out (Core ML payloads carry a
    random identifier, so two compiles of one model differ there)."""
    program = deserialize_pte(pte).program
    return program.execution_plan, [d.id for d in program.execution_plan[0].delegates]


@pytest.mark.slow  # eight resumes; the Core ML replay below stays in the default run
def test_an_xnnpack_run_resumed_from_any_stage_file_alone_emits_the_same_bytes(tmp_path):
    model, inputs = EXAMPLES["transformer"](depth=1)
    whole = compiler.compile(model, inputs, "xnnpack", backend_options={"per_op_mode": False}, dump_dir=tmp_path)
    files = sorted(tmp_path.glob("*.stage"))
    assert [f.stem.split("-", 1)[1] for f in files] == [s for s in STAGE_NAMES if s not in ("quantize", "emit")]
    for stage_file in files:
        resumed = compiler.compile(None, resume_from=stage_file)
        assert resumed.report.config == whole.report.config, stage_file.name
        assert resumed.program.plan == whole.program.plan, stage_file.name
        assert resumed.pte == whole.pte, stage_file.name


def test_a_core_ml_ios18_run_stopped_after_decompose_resumes_from_the_file_alone(tmp_path):
    model, inputs = decoder_step()
    whole = compiler.compile(model, inputs, "coreml", backend_options=IOS18)
    state = next(n for n in whole.stages["partition"].program.graph.nodes if n.name == "b_cache")
    assert state.meta.get("delegation_tag"), "the cache is Core ML state (iOS 18)"

    compiler.compile(model, inputs, "coreml", backend_options=IOS18, stop_after="decompose", dump_dir=tmp_path)
    resumed = compiler.compile(None, resume_from=tmp_path / "06-decompose.stage")

    assert resumed.report.config["backend_options"] == {"minimum_deployment_target": "iOS18"}
    assert resumed.program.plan == whole.program.plan
    assert program_without_payloads(resumed.pte) == program_without_payloads(whole.pte)
    assert read_models(resumed.pte) == read_models(whole.pte)


def test_without_the_recorded_options_the_resumed_run_would_differ(tmp_path):
    """The check above can fail: a Core ML run below iOS 18 keeps the cache a CPU buffer."""
    model, inputs = decoder_step()
    compiler.compile(model, inputs, "coreml", backend_options=IOS18, stop_after="decompose", dump_dir=tmp_path)
    default = compiler.compile(None, resume_from=tmp_path / "06-decompose.stage", backend_options={"minimum_deployment_target": "iOS17"})
    replayed = compiler.compile(None, resume_from=tmp_path / "06-decompose.stage")
    assert default.program.plan != replayed.program.plan
    assert [str(o) for o in default.report.overrides] == ["backend_options.minimum_deployment_target: 'iOS18' -> 'iOS17'"]


def test_an_option_given_at_resume_overrides_the_recorded_one_and_the_report_says_so(tmp_path):
    model, inputs = EXAMPLES["mlp"]()
    compiler.compile(model, inputs, "xnnpack", stop_after="capture", dump_dir=tmp_path, fold_skip_ops=["aten.t.default"])
    resumed = compiler.compile(None, resume_from=tmp_path / "02-capture.stage", emit_extract_delegate_segments=False)
    assert resumed.report.config["stages"]["fold"]["skip_ops"] == ["aten.t.default"]  # replayed
    assert [str(o) for o in resumed.report.overrides] == ["stages.emit.extract_delegate_segments: True -> False"]


def test_the_crash_reproducer_file_alone_replays_the_failing_run(tmp_path, monkeypatch):
    model, inputs = EXAMPLES["mlp"]()
    monkeypatch.setattr("compiler.stages.partition.Partition.apply", _exploding)
    with pytest.raises(compiler.StageFailure) as err:
        compiler.compile(model, inputs, "xnnpack", reproducer_dir=tmp_path, dry_run_mode="always")
    assert f"resume with: compiler.compile(None, resume_from={err.value.reproducer_path!r})" in str(err.value)
    monkeypatch.undo()
    resumed = compiler.compile(None, resume_from=err.value.reproducer_path)
    assert resumed.report.config["backend"] == "xnnpack"
    assert resumed.report.config["stages"]["dry_run"]["mode"] == "always"
    assert resumed.pte == compiler.compile(model, inputs, "xnnpack").pte


def _exploding(stage, edge, ctx):
    """The partition stage's run (the dry run may hand its search on: `partition()` alone
    would not be called)."""
    raise RuntimeError("partitioner exploded")


def test_the_same_through_the_command_line(tmp_path, capsys):
    factory = tmp_path / "step.py"
    factory.write_text("import torch\n\n" + inspect.getsource(DecoderStep) + "\n" + inspect.getsource(decoder_step))
    model = f"{factory}:decoder_step"
    option = ["--backend", "coreml", "--backend-option", "minimum_deployment_target=iOS18"]
    stage_file, resumed, whole = tmp_path / "d.stage", tmp_path / "resumed.pte", tmp_path / "whole.pte"
    assert main(["compile", model, *option, "--stop-after", "decompose", "-o", str(stage_file)]) == 0
    assert main(["compile", "--resume-from", str(stage_file), "-o", str(resumed)]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {stage_file} with its recorded configuration (backend coreml)" in out
    assert "overridden" not in out
    assert main(["compile", model, *option, "-o", str(whole)]) == 0
    assert program_without_payloads(resumed.read_bytes()) == program_without_payloads(whole.read_bytes())
    assert read_models(resumed.read_bytes()) == read_models(whole.read_bytes())

    assert main(["compile", "--resume-from", str(stage_file), "--backend-option", "minimum_deployment_target=iOS17"]) == 0
    assert "overridden: backend_options.minimum_deployment_target: 'iOS18' -> 'iOS17'" in capsys.readouterr().out


def test_a_dump_records_the_configuration_and_versions_beside_the_stage_files(tmp_path):
    model, inputs = EXAMPLES["mlp"]()
    compiler.compile(model, inputs, "xnnpack", stop_after="fold", dump_dir=tmp_path, dry_run_mode="never")
    recorded = json.loads((tmp_path / "config.json").read_text())
    assert recorded["config"]["backend"] == "xnnpack"
    assert recorded["config"]["stages"]["dry_run"] == {"mode": "never"}
    assert torch.__version__.startswith(recorded["versions"]["torch"])
    assert set(recorded["versions"]) == {"torch", "executorch", "coremltools", "mlx"}


def test_the_command_line_shows_a_failure_in_its_own_terms(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("compiler.stages.partition.Partition.apply", _exploding)
    assert main(["compile", "mlp", "--backend", "xnnpack", "--reproducer-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"resume with: python -m compiler compile --resume-from {tmp_path / 'decompose.stage'}" in err
    assert "--traceback shows where it failed" in err and "compiler.compile(" not in err


def test_a_resume_under_other_library_versions_says_so(tmp_path, monkeypatch):
    model, inputs = EXAMPLES["mlp"]()
    compiler.compile(model, inputs, stop_after="capture", dump_dir=tmp_path)
    installed = dependency_versions()
    monkeypatch.setattr(
        "compiler.api.dependency_versions", lambda: {**installed, "executorch": "9.9.9"}
    )
    report = compiler.compile(None, resume_from=tmp_path / "02-capture.stage", stop_after="fold").report
    assert [str(o) for o in report.overrides] == [f"versions.executorch: {installed['executorch']!r} -> '9.9.9'"]
