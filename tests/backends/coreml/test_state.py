"""State (mutable buffers) between Core ML and the CPU."""

import coremltools as ct
import pytest
import torch
import torch.nn as nn

import compiler

from executorch.backends.apple.coreml.compiler import CoreMLBackend as EtCoreML

from compiler.backends.coreml import CoreMLStateSplit
from compiler.ir.errors import CompileError
from coreml_helpers import compile_coreml, cpu_ops, stock_error


class SplitState(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 4))

    def forward(self, x):
        seen = torch.cumsum(self.cache, -1)  # reads the buffer on the CPU (skipped below)
        self.cache.add_(x)  # and updates it in Core ML
        return seen + self.cache.sin()


def test_state_split_between_core_ml_and_cpu_fails_naming_the_ops():
    with pytest.raises(CoreMLStateSplit) as err:
        compile_coreml(
            SplitState(), (torch.randn(1, 4),),
            skip_ops_for_coreml_delegation=["aten.cumsum.default"],
            minimum_deployment_target="iOS18",
        )
    text = str(err.value)
    assert "take_over_mutable_buffer=False" in text
    assert "aten.cumsum.default) on cpu" in text and "aten.add.Tensor) on tag" in text


def test_state_split_compiles_with_take_over_mutable_buffer_false():
    # The buffer stays CPU-owned; Core ML reads it as an input and returns the new value.
    artifact = compiler.compile(
        SplitState().eval(), (torch.randn(1, 4),), "coreml",
        backend_options=dict(
            skip_ops_for_coreml_delegation=["aten.cumsum.default"], take_over_mutable_buffer=False
        ),
    )
    assert "aten.cumsum.default" in cpu_ops(artifact).values()
    assert artifact.program.delegates
    buffer = next(n for n in artifact.stages["partition"].program.graph.nodes if n.name == "b_cache")
    assert "delegation_tag" not in buffer.meta


class CpuOnlyState(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(1, 4))

    def forward(self, x):
        self.count.copy_(torch.cumsum(self.count, -1))
        return x * 2


def test_state_only_the_cpu_uses_stays_on_the_cpu():
    artifact = compile_coreml(
        CpuOnlyState(), (torch.randn(1, 4),), skip_ops_for_coreml_delegation=["aten.cumsum"]
    )
    assert "aten.cumsum.default" in cpu_ops(artifact).values()
    assert artifact.program.delegates == ("CoreMLBackend",)


class CoreMLState(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 4))

    def forward(self, x):
        self.cache.add_(x)
        return self.cache.sin()


def test_below_ios18_the_buffer_stays_on_the_cpu_and_its_ops_in_core_ml():
    model, inputs = CoreMLState(), (torch.randn(1, 4),)
    assert "State model is supported only >= iOS18" in stock_error(model, inputs)
    artifact = compile_coreml(model, inputs)
    assert not cpu_ops(artifact)
    lowered = artifact.stages["lower"].program
    assert lowered.graph_signature.buffers_to_mutate, "the CPU owns the buffer and writes its new value"
    artifact = compile_coreml(model, inputs, minimum_deployment_target="iOS18")
    assert not cpu_ops(artifact)
    assert not artifact.stages["lower"].program.graph_signature.buffers_to_mutate, "Core ML state"


class UpdatedValueReadOnCpu(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 4))

    def forward(self, x):
        self.cache.add_(x)  # in Core ML
        return torch.cumsum(self.cache, -1)  # reads the new value on the CPU (skipped below)


def test_updated_state_read_on_cpu_is_a_split():
    # Without this check the lowering failed with "Cannot lower a model with no outputs in CoreML",
    # as stock does.
    assert "Cannot lower a model with no outputs in CoreML" in stock_error(
        UpdatedValueReadOnCpu(), (torch.randn(1, 4),),
        skip_ops_for_coreml_delegation=["aten.cumsum.default"],
        compile_specs=EtCoreML.generate_compile_specs(minimum_deployment_target=ct.target.iOS18),
    )
    with pytest.raises(CoreMLStateSplit) as err:
        compile_coreml(
            UpdatedValueReadOnCpu(), (torch.randn(1, 4),),
            skip_ops_for_coreml_delegation=["aten.cumsum.default"],
            minimum_deployment_target="iOS18",
        )
    assert "aten.cumsum.default) on cpu" in str(err.value)


class RunningTotal(nn.Module):
    def __init__(self, start: float):
        super().__init__()
        self.register_buffer("total", torch.full((1, 4), start))

    def forward(self, x):
        self.total.add_(x)
        return self.total.sin()


def _buffer_tag(artifact):
    placeholder = next(n for n in artifact.stages["partition"].program.graph.nodes if n.name == "b_total")
    return placeholder.meta.get("delegation_tag")


def test_state_that_does_not_start_at_zero_stays_cpu_owned():
    # Core ML state carries no initial value; a CPU-owned buffer is emitted with it.
    artifact = compile_coreml(RunningTotal(2.0), (torch.randn(1, 4),), minimum_deployment_target="iOS18")
    assert _buffer_tag(artifact) is None and not cpu_ops(artifact)
    assert artifact.report.stage("emit").metrics["initialized_state"] == 1
    zero_start = compile_coreml(RunningTotal(0.0), (torch.randn(1, 4),), minimum_deployment_target="iOS18")
    assert _buffer_tag(zero_start) is not None  # becomes Core ML state
