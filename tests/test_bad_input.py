"""Each bad input gets one named CompileError that names the stage and what to do."""

import sys
import zipfile

import pytest
import torch

import compiler
from compiler.ir.errors import CaptureError, CompileError, ResumeError, UserInputError


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # Python control flow on a tensor value: export cannot trace it
            return x * 2
        return x


def test_module_export_cannot_capture():
    with pytest.raises(CaptureError) as err:
        compiler.compile(DataDependent(), (torch.randn(3),))
    assert err.value.stage == "capture"
    assert "DataDependent" in str(err.value)
    assert "what to do" in str(err.value)


SCHEDULER = """\
import torch


class Scheduler:
    def step(self, sample, timestep):
        prev_timestep = timestep - 10
        if prev_timestep >= 0:  # a tensor timestep: export cannot branch on its value
            return sample * 0.5
        return sample
"""


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_untraceable_library_code_is_named_by_file_and_line(tmp_path, monkeypatch, strict):
    """A diffusion scheduler's `prev_timestep >= 0` on a tensor timestep: torch's message names
    a guard (`Eq(u0, 1)`) or a bytecode jump; ours names the library line where tracing stopped,
    the model's line that called it, and the ways out."""
    (tmp_path / "scheduler_lib.py").write_text(SCHEDULER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "scheduler_lib", raising=False)  # each case imports its own file
    from scheduler_lib import Scheduler

    class Denoiser(torch.nn.Module):
        def forward(self, sample, timestep):
            return Scheduler().step(sample * 2, timestep)  # the model's line

    with pytest.raises(CaptureError) as err:
        compiler.compile(Denoiser(), (torch.randn(3), torch.tensor(5)), capture_strict=strict)
    message = str(err.value)
    library_line = SCHEDULER.splitlines().index("        if prev_timestep >= 0:  # a tensor timestep: export cannot branch on its value") + 1
    assert f"tracing stopped at {tmp_path / 'scheduler_lib.py'}:{library_line} in step: if prev_timestep >= 0" in message
    assert f"reached from {__file__}:" in message and "in forward: return Scheduler().step(sample * 2, timestep)" in message
    assert "control flow depends on a tensor's value" in message
    assert all(way in err.value.hint for way in ("torch.cond", "Python numbers", "torch._check"))


@pytest.mark.parametrize("inputs", [{"x": torch.randn(2)}, "tensor", (torch.randn(2), object())])
def test_example_inputs_of_wrong_type(small_model, inputs):
    model, _ = small_model
    with pytest.raises(UserInputError) as err:
        compiler.compile(model, inputs)
    assert err.value.stage == "capture" and err.value.hint


def test_model_that_is_not_a_module():
    with pytest.raises(UserInputError, match="must be a torch.nn.Module"):
        compiler.compile(torch.nn.Linear, (torch.randn(2, 2),))


def test_unknown_backend(small_model):
    model, inputs = small_model
    with pytest.raises(UserInputError) as err:
        compiler.compile(model, inputs, "tpu")
    assert "unknown backend 'tpu'" in str(err.value) and "xnnpack" in err.value.hint


@pytest.mark.parametrize(
    "backend, options, listed",
    [
        ("portable", {"fast": True}, "none"),
        ("xnnpack", {"bogus_key": 1}, "per_op_mode"),  # XnnpackPartitioner(**kwargs) takes anything
        ("coreml", {"minimum_target": "iOS18"}, "minimum_deployment_target"),
    ],
)
def test_unknown_backend_option_is_named_with_the_valid_ones(small_model, backend, options, listed):
    model, inputs = small_model
    with pytest.raises(UserInputError) as err:
        compiler.compile(model, inputs, backend, backend_options=options)
    assert f"the {backend} backend has no option {next(iter(options))!r}" in str(err.value)
    assert listed in err.value.hint


def test_unknown_stage_name(small_model):
    model, inputs = small_model
    with pytest.raises(UserInputError) as err:
        compiler.compile(model, inputs, stop_after="optimize")
    assert "unknown stage 'optimize'" in str(err.value) and "partition" in err.value.hint


def test_unknown_driver_option(small_model):
    model, inputs = small_model
    with pytest.raises(UserInputError, match="unknown option.*: dump") as err:
        compiler.compile(model, inputs, dump="x", fold_skip_op="aten.t.default")
    assert "fold_skip_op" in str(err.value) and "dump_dir" in err.value.hint and "fold_skip_ops" in err.value.hint


def test_resume_file_that_does_not_exist(tmp_path):
    with pytest.raises(ResumeError, match="does not exist"):
        compiler.compile(None, None, resume_from=str(tmp_path / "nope.stage"))


def test_corrupt_resume_file(tmp_path):
    path = tmp_path / "bad.stage"
    path.write_bytes(b"not a zip at all")
    with pytest.raises(ResumeError, match="corrupt"):
        compiler.compile(None, None, resume_from=str(path))


def test_truncated_resume_file(small_model, tmp_path):
    model, inputs = small_model
    compiler.compile(model, inputs, stop_after="partition", dump_dir=tmp_path)
    good = (tmp_path / "07-partition.stage").read_bytes()
    path = tmp_path / "cut.stage"
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(ResumeError):
        compiler.compile(None, None, resume_from=str(path))


def test_zip_that_is_not_a_stage_file(tmp_path):
    path = tmp_path / "other.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("hello.txt", "hi")
    with pytest.raises(ResumeError, match="not a stage file"):
        compiler.compile(None, None, resume_from=str(path))


def test_resume_file_from_a_later_stage_than_stop_after(small_model, tmp_path):
    model, inputs = small_model
    compiler.compile(model, inputs, stop_after="partition", dump_dir=tmp_path)
    with pytest.raises(ResumeError, match="nothing to run"):
        compiler.compile(None, None, resume_from=str(tmp_path / "07-partition.stage"), stop_after="decompose")


def test_a_stage_file_planned_for_one_backend_cannot_go_on_for_another(small_model, tmp_path):
    model, inputs = small_model
    compiler.compile(model, inputs, "xnnpack", stop_after="partition", dump_dir=tmp_path)
    with pytest.raises(ResumeError, match="planned for backend 'xnnpack' after partition; it cannot go on for 'portable'"):
        compiler.compile(None, None, "portable", resume_from=str(tmp_path / "07-partition.stage"))


def test_a_captured_program_can_go_on_for_another_backend_and_the_report_says_so(small_model, tmp_path):
    model, inputs = small_model
    compiler.compile(model, inputs, "xnnpack", stop_after="fold", dump_dir=tmp_path)
    artifact = compiler.compile(None, None, "portable", resume_from=str(tmp_path / "04-fold.stage"))
    assert artifact.report.config["backend"] == "portable" and not artifact.program.delegates
    assert [str(o) for o in artifact.report.overrides] == ["backend: 'xnnpack' -> 'portable'"]


def test_every_error_is_a_compile_error():
    for error_type in (CaptureError, ResumeError, UserInputError, compiler.VerificationError, compiler.StageFailure):
        assert issubclass(error_type, CompileError)
