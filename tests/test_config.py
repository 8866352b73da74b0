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
    stage_file = tmp_path / "04-decompose.stage"
    with pytest.raises(ResumeError, match="could not record the backend option.*configs") as err:
        compiler.compile(None, resume_from=stage_file)
    assert "OwnLinearConfig" in str(err.value)
    resumed = compiler.compile(None, resume_from=stage_file, backend_options=options)
    assert resumed.program.delegates
