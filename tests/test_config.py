"""The compile configuration: typed stage options, one name per option, and a JSON form
that loads back as the same configuration (what stage files record)."""

import coremltools as ct
import pytest
import torch

import compiler
from compiler.driver.config import CompileConfig, decode, options
from compiler.stages.options import DryRunOptions, FoldOptions
from compiler.models.examples import EXAMPLES
from compiler.ir.errors import ResumeError, UserInputError
from executorch.backends.apple.coreml.compiler import CoreMLBackend as EtCoreML
from executorch.backends.xnnpack.partition.config.gemm_configs import LinearConfig
from executorch.backends.xnnpack.partition.config.xnnpack_config import ConfigPrecisionType, XNNPartitionerConfig


def test_backend_options_of_every_kind_load_back_equal():
    config = CompileConfig(
        "coreml",
        {
            "compile_specs": [EtCoreML.generate_compute_precision_compile_spec(ct.precision.FLOAT32)],
            "minimum_deployment_target": ct.target.iOS18,
            "skip_ops_for_coreml_delegation": ["aten.add.Tensor"],
            "lower_full_graph": False,
        },
        fold=FoldOptions(skip_ops=("aten.t.default",)),
        dry_run=DryRunOptions("always"),
    )
    assert CompileConfig.from_json(config.to_json()) == config
    xnnpack = CompileConfig("xnnpack", {"configs": [LinearConfig], "config_precisions": ConfigPrecisionType.FP32})
    assert CompileConfig.from_json(xnnpack.to_json()) == xnnpack


def test_a_stage_file_never_imports_a_module_outside_the_libraries_it_configures():
    with pytest.raises(ValueError, match="refusing to import 'os'"):
        decode({"$type": "os:system"})


def test_stage_options_are_typed_and_checked():
    assert FoldOptions(skip_ops=[torch.ops.aten.t.default]).skip_ops == ("aten.t.default",)
    with pytest.raises(UserInputError, match="unknown dry_run_mode 'sometimes'"):
        DryRunOptions("sometimes")
    with pytest.raises(UserInputError, match="unknown option.*fold_skip"):
        CompileConfig().with_options({"fold_skip": ("aten.t.default",)})


def test_every_option_has_one_name_a_flag_and_help():
    names = [spec.name for spec in options()]
    assert len(names) == len(set(names))
    assert {"fold_skip_ops", "dry_run_mode", "emit_stacktrace", "verify", "reproducer", "stop_after"} <= set(names)
    assert all(spec.help and spec.flag.startswith("--") for spec in options())


class OwnLinearConfig(LinearConfig):
    """A user's own partitioner config: a class the stage file can name but must not import."""


def test_a_backend_option_a_stage_file_cannot_record_must_be_given_again(tmp_path):
    assert issubclass(OwnLinearConfig, XNNPartitionerConfig)
    model, inputs = EXAMPLES["mlp"]()
    options = {"configs": [OwnLinearConfig]}
    whole = compiler.compile(model, inputs, "xnnpack", backend_options=options, stop_after="decompose", dump_dir=tmp_path)
    assert whole is not None
    stage_file = tmp_path / "06-decompose.stage"
    with pytest.raises(ResumeError, match="could not record the backend option.*configs") as err:
        compiler.compile(None, resume_from=stage_file)
    assert "OwnLinearConfig" in str(err.value)
    resumed = compiler.compile(None, resume_from=stage_file, backend_options=options)
    assert resumed.program.delegates


# --- option values against their declared kinds ---------------------------------------


@pytest.mark.parametrize(
    ("given", "named"),
    [
        ({"fold_replace_skip_ops": "no"}, "option fold_replace_skip_ops takes a bool, got str 'no'"),
        ({"fold_skip_ops": [3]}, "option fold_skip_ops takes a str"),
        ({"emit_stacktrace": 1}, "option emit_stacktrace takes a bool, got int 1"),
        ({"cache_max_mb": True}, "option cache_max_mb takes a int, got the bool True"),
        ({"cache_max_mb": "4096"}, "option cache_max_mb takes a int, got str '4096'"),
        ({"dump_dir": 7}, "option dump_dir takes a str, got int 7"),
    ],
)
def test_an_option_of_the_wrong_kind_is_refused_by_name_before_any_work(given, named):
    model, inputs = EXAMPLES["mlp"]()
    with pytest.raises(UserInputError, match=named.replace("(", r"\(")) as caught:
        compiler.compile(model, inputs, **given)
    assert caught.value.stage is None and "give a" in str(caught.value)


def test_values_of_an_option_kind_pass(tmp_path):
    """Paths as path objects, a stream for print_after_change, op objects for ops."""
    config = CompileConfig().with_options({"fold_skip_ops": [torch.ops.aten.t.default], "fold_replace_skip_ops": True})
    assert config.fold == FoldOptions(("aten.t.default",), True)
    with pytest.raises(UserInputError, match="FoldOptions.replace_skip_ops takes a bool"):
        FoldOptions(replace_skip_ops="yes")  # built directly: the same check, by field
    import io

    from compiler.driver.config import split_options

    _, driving = split_options({"dump_dir": tmp_path, "print_after_change": io.StringIO(), "cache_max_mb": 10})
    assert driving.dump_dir == tmp_path and driving.cache_max_mb == 10


# --- the one table of stages -----------------------------------------------------------


def test_the_configuration_the_flags_and_the_pipeline_derive_from_the_table_of_stages(capsys):
    import attrs

    from compiler.cli.main import _parser
    from compiler.stages import STAGE_NAMES, STAGE_OPTIONS, STAGES, default_stages

    fields = [f.name for f in attrs.fields(CompileConfig)]
    assert fields == ["backend", "backend_options", *STAGE_OPTIONS]  # one field per stage with options
    assert [stage.name for stage in default_stages()] == [row.name for row in STAGES] == list(STAGE_NAMES)
    assert all(type(stage).__module__ == row.module for stage, row in zip(default_stages(), STAGES, strict=True))
    assert all(stage.options is row.options for stage, row in zip(default_stages(), STAGES, strict=True))
    for name in STAGE_NAMES:
        assert _parser().parse_args(["compile", "mlp", "--stop-after", name]).stop_after == name
    with pytest.raises(SystemExit):
        _parser().parse_args(["compile", "mlp", "--stop-after", "optimize"])
    assert "choose from " + ", ".join(map(repr, STAGE_NAMES)) in capsys.readouterr().err
    stage_options = {spec.stage for spec in options() if spec.stage}
    assert stage_options == set(STAGE_OPTIONS)


def test_a_stage_outside_the_table_must_be_named():
    from compiler.ir.artifacts import AtenProgram
    from compiler.stages.base import Stage

    with pytest.raises(TypeError, match="not in compiler.stages.STAGES: give it a name="):

        class Unnamed(Stage, takes=AtenProgram, returns=AtenProgram):
            def apply(self, artifact, ctx):
                return artifact

    class Named(Stage, name="mine", takes=AtenProgram, returns=AtenProgram):
        def apply(self, artifact, ctx):
            return artifact

    assert Named.name == "mine" and Named.options.__name__ == "NoOptions"
