"""A stage never changes the program it was given: every stage's artifact a run keeps (the
result's `stages`, what a float32 re-conversion or a bisection runs again) is what its stage
made. ExecuTorch's `to_backend` deleted the constants its delegates took from the table of
the program it was given, so the partition stage's artifact lost them at lower."""

import pytest
import torch

import compiler
from compiler.driver.config import DriverOptions
from compiler.driver.instruments import instruments_for
from compiler.driver.pipeline import Pipeline
from compiler.ir.artifacts import PartitionedProgram, SplitProgram
from compiler.ir.errors import VerificationError
from compiler.stages import default_stages
from compiler.stages.split_constants import SplitConstants
from compiler.backends import resolve
from tiny_models import RandomProgram


def _model_and_inputs():
    torch.manual_seed(0)
    return RandomProgram().eval(), (torch.randn(2, 2, 4), torch.randn(4, 4))


def test_the_program_given_to_lower_keeps_its_constants_and_lowers_again():
    model, inputs = _model_and_inputs()
    result = compiler.compile(model, inputs, "xnnpack")
    given = result.stages["split_constants"].program
    named = {s.target for s in given.graph_signature.input_specs if s.kind.name == "CONSTANT_TENSOR"}
    assert named and named <= set(given.constants)
    again = Pipeline(default_stages()).execute(
        result.stages["split_constants"], resolve("xnnpack", {}), result.config,
        instruments_for(DriverOptions()), start_after="split_constants",
    )
    outputs = compiler.run(again.artifact, inputs)
    for got, want in zip(outputs, model(*inputs)):
        torch.testing.assert_close(got, want)


class SplitConstantsThatDropsAnInputConstant(
    SplitConstants, takes=PartitionedProgram, returns=SplitProgram, name="split_constants"
):
    def apply(self, partitioned, ctx):
        output = super().apply(partitioned, ctx)
        partitioned.program.constants.pop(next(iter(partitioned.program.constants)))
        return output


def test_a_stage_that_changes_its_input_is_named_by_verify_each():
    model, inputs = _model_and_inputs()
    stages = [SplitConstantsThatDropsAnInputConstant() if s.name == "split_constants" else s for s in default_stages()]
    before = compiler.compile(model, inputs, "xnnpack", stop_after="partition")
    with pytest.raises(VerificationError) as caught:
        Pipeline(stages).execute(
            before.artifact, resolve("xnnpack", {}), before.config, instruments_for(DriverOptions()),
            start_after="partition",
        )
    error = caught.value
    assert error.invariant == "stage_input_kept" and error.stage == "split_constants"
    assert "its constants: removed _folded_constant_0" in str(error)
