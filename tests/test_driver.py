"""The pipeline: type chaining, stop/resume, instruments, the crash reproducer."""

import io
import os

import pytest
import torch

import compiler
from compiler.backends.xnnpack import XnnpackBackend
from compiler.driver.pipeline import Pipeline
from compiler.models.examples import transformer
from compiler.driver.instruments import Instrument
from compiler.ir.artifacts import EdgeProgram, PartitionedProgram
from compiler.ir.errors import PipelineError, StageFailure
from compiler.stages import STAGE_NAMES, default_stages


def test_pipeline_whose_types_do_not_chain_is_refused_before_running():
    quantize, capture, precision, fold, dry_run, decompose, partition, split, lower, emit = default_stages()
    with pytest.raises(PipelineError) as err:
        Pipeline([capture, partition, lower])
    assert "'capture' returns AtenProgram" in str(err.value)
    assert "'partition' takes EdgeProgram" in str(err.value)


def test_default_pipeline_chains():
    assert Pipeline(default_stages()).names == STAGE_NAMES


def test_artifact_has_pte_report_and_every_stage(small_model, tmp_path):
    model, inputs = small_model
    artifact = compiler.compile(model, inputs, "xnnpack")
    assert artifact.pte[4:8] == b"ET12"  # the flatbuffer file identifier of a .pte
    assert [r.stage for r in artifact.report.stages] == list(STAGE_NAMES)
    assert set(artifact.stages) == set(STAGE_NAMES)
    assert isinstance(artifact.stages["partition"], PartitionedProgram)
    partition = artifact.report.stage("partition")
    assert partition.delegates >= 1 and partition.cpu_ops == 1  # the cumsum
    cpu_rows = [row for row in artifact.report.placement if row.where == "cpu"]
    assert [row.op for row in cpu_rows] == ["aten.cumsum.default"]
    assert "cumsum" in cpu_rows[0].reason
    artifact.save(tmp_path / "m.pte")
    assert (tmp_path / "m.pte").read_bytes() == artifact.pte


def test_compile_returns_one_result_wherever_it_stops(small_model, tmp_path):
    model, inputs = small_model
    stopped = compiler.compile(model, inputs, "xnnpack", stop_after="partition")
    assert type(stopped) is compiler.CompileResult and stopped.stopped_after == "partition"
    assert isinstance(stopped.artifact, PartitionedProgram) and stopped.stages["partition"] is stopped.artifact
    assert list(stopped.stages) == list(STAGE_NAMES[: STAGE_NAMES.index("partition") + 1])
    assert stopped.config.backend == "xnnpack" and [r.stage for r in stopped.report.stages][-1] == "partition"
    for needs_a_program in (lambda: stopped.pte, lambda: stopped.save(tmp_path / "x.pte"), lambda: stopped.run(*inputs)):
        with pytest.raises(compiler.UserInputError, match="stopped after partition: it has a PartitionedProgram"):
            needs_a_program()
    assert not (tmp_path / "x.pte").exists()
    whole = compiler.compile(model, inputs, "xnnpack")
    torch.testing.assert_close(whole.run(*inputs)[0], compiler.run(whole, inputs)[0])


def test_earlier_stage_artifacts_are_not_changed_by_later_stages(small_model):
    model, inputs = small_model
    artifact = compiler.compile(model, inputs, "xnnpack")
    edge = artifact.stages["decompose"].program
    assert not any("delegation_tag" in n.meta for n in edge.graph.nodes)
    tagged = artifact.stages["partition"].program
    assert any("delegation_tag" in n.meta for n in tagged.graph.nodes)


@pytest.mark.parametrize("stop", ["fold", "partition", "lower"])
def test_stop_and_resume_gives_byte_identical_pte(small_model, tmp_path, stop):
    model, inputs = small_model
    whole = compiler.compile(model, inputs, "xnnpack")
    stopped = compiler.compile(model, inputs, "xnnpack", stop_after=stop, dump_dir=tmp_path)
    assert stopped.stopped_after == stop and type(stopped.artifact) is type(whole.stages[stop])
    stage_file = tmp_path / f"{STAGE_NAMES.index(stop) + 1:02d}-{stop}.stage"
    resumed = compiler.compile(None, None, "xnnpack", resume_from=str(stage_file))
    assert resumed.pte == whole.pte
    assert [r.stage for r in resumed.report.stages] == list(STAGE_NAMES[STAGE_NAMES.index(stop) + 1 :])


@pytest.mark.parametrize(
    "backend, stop",
    [("coreml", "partition"), ("coreml", "lower"), ("mlx", "fold"), ("mlx", "partition"), ("mlx", "split_constants")],
)
def test_resume_with_ops_kept_whole_and_multi_output_ops(tmp_path, backend, stop):
    """Stage files keep what the deserializer loses: the Edge verifier that allows the ops kept
    whole, tuple accesses only where the program had them, input names (MLX hashes them)."""
    model, inputs = transformer(depth=1, dim=32, heads=2, seq=8)
    whole = compiler.compile(model, inputs, backend)
    assert whole.stages["decompose"].preserved_ops  # e.g. aten.linear kept whole for the backend
    compiler.compile(model, inputs, backend, stop_after=stop, dump_dir=tmp_path)
    stage_file = tmp_path / f"{STAGE_NAMES.index(stop) + 1:02d}-{stop}.stage"
    resumed = compiler.compile(None, None, backend, resume_from=str(stage_file))
    assert resumed.pte == whole.pte  # Core ML's too: its payload ids are derived from the content
    assert resumed.program.operators == whole.program.operators


def test_dump_dir_holds_text_and_resumable_file_per_stage(small_model, tmp_path):
    model, inputs = small_model
    compiler.compile(model, inputs, "xnnpack", dump_dir=tmp_path)
    names = sorted(os.listdir(tmp_path))
    for i, stage in enumerate(STAGE_NAMES, start=1):
        assert f"{i:02d}-{stage}.txt" in names
    assert "10-emit.pte" in names
    assert "07-partition.stage" in names
    assert "aten_cumsum_default" in (tmp_path / "06-decompose.txt").read_text()


def test_print_after_change_prints_only_stages_that_changed(small_model):
    model, inputs = small_model
    out = io.StringIO()
    compiler.compile(model, inputs, "xnnpack", print_after_change=out)
    text = out.getvalue()
    assert "after capture" in text and "after decompose" in text and "after lower" in text
    assert "after fold" not in text  # nothing to fold in this model


class FlakyXnnpack(XnnpackBackend):
    """Fails its first partition search, like a backend bug would."""

    def __init__(self, fail: bool):
        super().__init__()
        self.fail = fail

    def partition(self, program):
        if self.fail:
            raise RuntimeError("partitioner exploded")
        return super().partition(program)


def test_crash_reproducer_saves_stage_input_that_resumes(small_model, tmp_path):
    model, inputs = small_model
    with pytest.raises(StageFailure) as err:
        compiler.compile(model, inputs, FlakyXnnpack(fail=True), reproducer_dir=tmp_path)
    error = err.value
    assert error.stage == "partition"
    assert "partitioner exploded" in str(error)
    assert isinstance(error.__cause__, RuntimeError)
    assert error.reproducer_path == str(tmp_path / "decompose.stage")
    assert f"resume with: compiler.compile(None, resume_from={error.reproducer_path!r})" in str(error)

    resumed = compiler.compile(None, None, FlakyXnnpack(fail=False), resume_from=error.reproducer_path)
    reference = compiler.compile(model, inputs, "xnnpack")
    assert resumed.pte == reference.pte


def test_failure_after_dumping_keeps_last_good_artifact(small_model, tmp_path):
    model, inputs = small_model
    with pytest.raises(StageFailure):
        compiler.compile(model, inputs, FlakyXnnpack(fail=True), dump_dir=tmp_path)
    assert (tmp_path / "06-decompose.stage").exists()
    assert not (tmp_path / "07-partition.stage").exists()


class Recorder(Instrument):
    def __init__(self):
        self.calls = []

    def before_stage(self, stage, artifact):
        self.calls.append(("before", stage))

    def after_stage(self, stage, before, after):
        self.calls.append(("after", stage))


def test_user_instruments_see_every_stage(small_model):
    model, inputs = small_model
    recorder = Recorder()
    compiler.compile(model, inputs, "portable", instruments=[recorder])
    assert recorder.calls[:4] == [("before", "quantize"), ("after", "quantize"), ("before", "capture"), ("after", "capture")]
    assert len(recorder.calls) == 2 * len(STAGE_NAMES)


def test_no_verify_skips_verification(small_model):
    model, inputs = small_model
    artifact = compiler.compile(model, inputs, "portable", verify=False)
    assert all(r.verify_seconds == 0.0 for r in artifact.report.stages)


def test_dynamic_shapes_pass_through_capture():
    model = torch.nn.Linear(4, 4).eval()
    batch = torch.export.Dim("batch", min=1, max=16)
    aten = compiler.compile(model, (torch.randn(3, 4),), stop_after="capture", dynamic_shapes=({0: batch},)).artifact
    placeholder = next(n for n in aten.program.graph.nodes if n.name == "input")
    assert not isinstance(placeholder.meta["val"].shape[0], int)
    artifact = compiler.compile(model, (torch.randn(3, 4),), "xnnpack", dynamic_shapes=({0: batch},))
    out = compiler.run(artifact, (torch.ones(5, 4),))[0]
    torch.testing.assert_close(out, model(torch.ones(5, 4)), atol=1e-5, rtol=1e-5)


def test_emit_leaves_the_lowered_artifact_as_lower_returned_it(small_model):
    model, inputs = small_model
    artifact = compiler.compile(model, inputs, "portable")
    lowered = artifact.report.stage("lower")
    assert artifact.report.stage("emit").nodes_in == lowered.nodes_out
    assert "alloc" not in artifact.stages["lower"].graph_text()


def test_a_program_passed_through_unchanged_is_not_verified_again(small_model, monkeypatch):
    from compiler.ir import invariants as inv

    checked = []
    original = inv.Invariant.verify
    monkeypatch.setattr(inv.Invariant, "verify", lambda self, a, s=None: (checked.append((s, self.name)), original(self, a, s)))
    model, inputs = small_model
    compiler.compile(model, inputs, "xnnpack")
    assert ("capture", "program_validates") in checked
    assert not [c for c in checked if c[0] in ("fold", "dry_run")]  # same program as capture's


def test_a_resumed_program_is_verified_in_full(small_model, tmp_path, monkeypatch):
    from compiler.ir import invariants as inv

    model, inputs = small_model
    compiler.compile(model, inputs, "xnnpack", stop_after="fold", dump_dir=tmp_path)
    checked = []
    original = inv.Invariant.verify
    monkeypatch.setattr(inv.Invariant, "verify", lambda self, a, s=None: (checked.append((s, self.name)), original(self, a, s)))
    compiler.compile(None, None, "xnnpack", resume_from=str(tmp_path / "04-fold.stage"))
    assert ("dry_run", "program_validates") in checked  # the loaded program was never checked in this run


class ReturnsMaxAlongDim(torch.nn.Module):
    def forward(self, x):
        return x.max(dim=-1)  # a torch.return_types.max, not a tuple


def test_a_model_returning_return_types_compiles():
    model, x = ReturnsMaxAlongDim(), torch.randn(3, 5)
    artifact = compiler.compile(model, (x,), "portable")
    assert [torch.equal(a, b) for a, b in zip(compiler.run(artifact, (x,)), model(x), strict=True)] == [True, True]


def test_a_results_stages_are_the_stage_tables_by_attribute_each_of_its_stages_type():
    """`result.stages.partition` is typed: the fields are the stage table's names, each of the type
    its stage returns (or a subclass of it)."""
    import typing

    import attrs

    from compiler.ir import artifacts
    from compiler.stages import STAGES

    fields = attrs.fields(artifacts.StageArtifacts)
    assert [field.name for field in fields] == [row.name for row in STAGES]
    hints = typing.get_type_hints(artifacts.StageArtifacts, vars(artifacts))
    for row in STAGES:
        (declared,) = [t for t in typing.get_args(hints[row.name]) if t is not type(None)]
        returns = row.load().returns
        assert issubclass(returns, declared) or issubclass(declared, returns), (row.name, declared, returns)


def test_a_compile_result_gives_each_stage_by_attribute_and_by_name():
    import torch

    import compiler
    from compiler.ir.artifacts import PartitionedProgram

    result = compiler.compile(torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4),), "xnnpack", cache=False)
    assert isinstance(result.stages.partition, PartitionedProgram)
    assert result.stages["partition"] is result.stages.partition
    stopped = compiler.compile(torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4),), "xnnpack", cache=False,
                               stop_after="fold")
    assert stopped.stages.partition is None and "partition" not in stopped.stages
    assert list(stopped.stages) == ["quantize", "capture", "precision", "fold"]
