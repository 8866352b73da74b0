"""The lower stage skips the checks its dependencies repeat after every step, unless the run
option `dependency_checks` asks for them: ExecuTorch's `to_backend` validates the
ExportedProgram again and again (our verification validates the stage's input and output),
and coremltools validates the whole MIL program before each pass pipeline and after every
pass (it still validates it once converted, and once more before serializing it). The
payload is the same either way, and an invalid MIL program still fails with coremltools'
own error."""

from __future__ import annotations

import pathlib
import tempfile

import pytest
from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager
from coremltools.converters.mil.mil.program import Program
from torch.export import ExportedProgram

import compiler
from compiler.models import examples
from compiler.backends.coreml.payload import coreml_payloads
from compiler.ir.errors import StageFailure
from mil_breakage import break_gelu_converter, break_in_pass

# coremltools validates the MIL program outside its pass pipelines three times: once the
# torch frontend has converted it, and when its MIL backend builds the MIL and the Core ML
# protos (after the last pipeline).
MIL_VALIDATIONS_KEPT = 3


class CountInLower(compiler.Instrument):
    """Counts ExportedProgram and MIL program validations during the lower stage, its
    verification included (this instrument's hooks run outside VerifyEach's), and the
    passes of each MIL pipeline that runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counting = False
        self.exported_program = self.mil_program = 0
        self.pipelines: list[int] = []  # each pipeline's number of passes
        validate_ep, validate_mil = ExportedProgram._validate, Program.validate
        apply_pipeline = PassPipelineManager.apply_pipeline

        def count_ep(program, *args, **kwargs):
            self.exported_program += self.counting
            return validate_ep(program, *args, **kwargs)

        def count_mil(program, *args, **kwargs):
            self.mil_program += self.counting
            return validate_mil(program, *args, **kwargs)

        def count_pipeline(program, pipeline):
            if self.counting:
                self.pipelines.append(len(pipeline.passes))
            return apply_pipeline(program, pipeline)

        monkeypatch.setattr(ExportedProgram, "_validate", count_ep)
        monkeypatch.setattr(Program, "validate", count_mil)
        monkeypatch.setattr(PassPipelineManager, "apply_pipeline", staticmethod(count_pipeline))

    def before_stage(self, stage, artifact):
        self.counting = stage == "lower"

    def after_stage(self, stage, before, after):
        self.counting = False


def _compile(backend: str, **options):
    model, inputs = examples.transformer(depth=2)
    return compiler.compile(model, inputs, backend, **options)


def _payload_files(pte: bytes) -> dict[str, bytes]:
    """The files of the one Core ML payload, its metadata and manifest included (their ids
    are derived from the content: compiler.backends.coreml.payload.reproducible)."""
    from executorch.backends.apple.coreml import executorchcoreml

    (payload,) = coreml_payloads(pte)
    with tempfile.TemporaryDirectory() as folder:
        executorchcoreml.unflatten_directory_contents(payload, folder)
        return {
            str(path.relative_to(folder)): path.read_bytes()
            for path in sorted(pathlib.Path(folder).rglob("*"))
            if path.is_file()
        }


def _mil_text(files: dict[str, bytes]) -> str:
    from coremltools.proto import Model_pb2

    (name,) = [n for n in files if n.endswith("model.mlmodel")]
    spec = Model_pb2.Model()
    spec.ParseFromString(files[name])
    return str(spec)


@pytest.fixture
def counts(monkeypatch):
    return CountInLower(monkeypatch)


def test_coreml_lower_validates_once_by_default_and_as_stock_with_dependency_checks(counts):
    skipped = _compile("coreml", instruments=(counts,))
    assert counts.pipelines and counts.mil_program == MIL_VALIDATIONS_KEPT
    # Only our verification of the lowered program.
    assert counts.exported_program == 1

    pipelines = counts.pipelines
    counts.exported_program = counts.mil_program = 0
    counts.pipelines = []
    checked = _compile("coreml", dependency_checks=True, instruments=(counts,))
    assert counts.pipelines == pipelines
    # coremltools validates before each pipeline and after each of its passes.
    assert counts.mil_program == MIL_VALIDATIONS_KEPT + sum(1 + passes for passes in pipelines)
    # to_backend validates the program it is given, each lowered owner, the result...
    assert counts.exported_program > 3

    files, stock_files = _payload_files(skipped.pte), _payload_files(checked.pte)
    assert _mil_text(files) == _mil_text(stock_files)
    assert files == stock_files
    assert skipped.pte == checked.pte  # the checks change nothing of the program


@pytest.mark.parametrize("backend", ["xnnpack", "mlx"])
def test_to_backend_validates_once_for_other_backends(counts, backend):
    _compile(backend, instruments=(counts,))
    assert counts.exported_program == 1  # our verification
    counts.exported_program = 0
    _compile(backend, dependency_checks=True, instruments=(counts,))
    assert counts.exported_program > 3


def test_the_checks_are_restored_after_the_stage(counts):
    _compile("coreml")
    assert ExportedProgram.__dict__["_validate"].__name__ == "count_ep"
    assert Program.__dict__["validate"].__name__ == "count_mil"
    assert isinstance(PassPipelineManager.__dict__["apply_pipeline"], staticmethod)
    assert PassPipelineManager.__dict__["apply_pipeline"].__func__.__name__ == "count_pipeline"


def test_an_invalid_converted_program_fails_with_coremltools_error(monkeypatch):
    """A converter (such as one of our fixes) that leaves the MIL block invalid is caught
    where coremltools validates the converted program, before any pass runs on it."""
    break_gelu_converter(monkeypatch)
    with pytest.raises(StageFailure) as failure:
        _compile("coreml")
    assert failure.value.stage == "lower"
    assert "should be consumed by op" in str(failure.value)
    assert type(failure.value.__cause__).__name__ == "InvalidBlockStateError"


# The last pass of coremltools 9.0's backend pipeline for an ML program.
LAST_PASS = "nn_backend::handle_unused_inputs"


@pytest.mark.parametrize("dependency_checks", [False, True])
def test_a_pass_that_breaks_the_program_is_caught_by_the_last_validation(monkeypatch, dependency_checks):
    """A MIL pass that leaves the program invalid fails the compile with coremltools' error:
    right after the pass with the dependency checks, else before the program is serialized."""
    broken = break_in_pass(monkeypatch, LAST_PASS)
    with pytest.raises(StageFailure) as failure:
        _compile("coreml", dependency_checks=dependency_checks)
    assert broken
    assert "should be consumed by op" in str(failure.value)
    assert type(failure.value.__cause__).__name__ == "InvalidBlockStateError"


def test_an_earlier_broken_pass_still_fails_the_compile(monkeypatch):
    """Without the per-pass validation, a program an earlier pass broke fails where the next
    pass or the last validation trips over it (here the next dead-code elimination)."""
    broken = break_in_pass(monkeypatch, "common::dead_code_elimination")
    with pytest.raises(StageFailure) as failure:
        _compile("coreml")
    assert broken
    assert f"Cannot delete op '{broken[0]}'" in str(failure.value)


def test_the_skip_is_per_thread_and_the_last_thread_out_restores(counts):
    """A thread that did not ask to skip still validates, while another skips; the original
    comes back once both have left (in either order), also on an exception."""
    import threading

    from compiler.ir.private_api import exported_program_validation_skipped

    model, inputs = examples.mlp()
    program = torch_export(model, inputs)
    counts.counting = True
    inside, other_left = threading.Barrier(2, timeout=30), threading.Event()
    seen, errors = {}, []

    def reporting(body):
        """The thread's body; a failure is kept for the test and releases the other thread."""

        def run() -> None:
            try:
                body()
            except BaseException as exc:
                errors.append(exc)
                inside.abort()

        return run

    @reporting
    def skipping() -> None:
        with exported_program_validation_skipped():
            inside.wait()
            before = counts.exported_program
            program.validate()
            seen["skipping"] = counts.exported_program - before
            assert other_left.wait(timeout=30)
            program.validate()  # still skipped after the other thread left
            seen["after the other left"] = counts.exported_program - before

    @reporting
    def validating() -> None:
        try:
            with exported_program_validation_skipped():
                inside.wait()
            before = counts.exported_program
            program.validate()
            seen["validating"] = counts.exported_program - before
        finally:
            other_left.set()

    threads = [threading.Thread(target=skipping), threading.Thread(target=validating)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert seen == {"skipping": 0, "validating": 1, "after the other left": 0}
    assert ExportedProgram.__dict__["_validate"].__name__ == "count_ep"

    with pytest.raises(RuntimeError), exported_program_validation_skipped():
        raise RuntimeError("a failed lowering")
    assert ExportedProgram.__dict__["_validate"].__name__ == "count_ep"
    program.validate()
    assert counts.exported_program >= 2


def torch_export(model, inputs):
    import torch

    with torch.no_grad():
        return torch.export.export(model, inputs, strict=False)
