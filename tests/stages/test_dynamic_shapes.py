"""A dynamic sequence dimension survives every stage that holds a program: each stage's output
still has the symbolic size on its input, and a stage (or a backend inside it) that fixes
the size fails the `dynamic_sizes_kept` invariant, naming the dimension, instead of handing
on a program that runs at the example's length only."""

import pytest
import torch

import compiler
from compiler.ir import invariants as inv
from compiler.ir.artifacts import AtenProgram
from compiler.ir.errors import UserInputError, VerificationError
from dynamic_shape_models import causal_attention, position_gather, symbolic_input_dims

STAGES_WITH_PROGRAMS = ("capture", "fold", "dry_run", "decompose", "partition", "split_constants", "lower")


@pytest.fixture(scope="module", params=["portable", "xnnpack", "coreml", "mlx"])
def compiled(request):
    model, inputs, dynamic = position_gather()
    # dry_run_mode=always: the dry run decomposes and partitions too, where MLX's handlers run.
    return compiler.compile(
        model, inputs, request.param, dynamic_shapes=dynamic, stop_after="lower", dry_run_mode="always"
    )


@pytest.mark.parametrize("stage", STAGES_WITH_PROGRAMS)
def test_stage_output_keeps_the_symbolic_size(compiled, stage):
    program = compiled.stages[stage].program
    assert symbolic_input_dims(program), f"{stage} fixed the sequence length"
    assert all(not key.is_number for key in program.range_constraints), program.range_constraints
    assert inv.dynamic_sizes_kept.check(compiled.stages[stage]) is None


def test_a_fixed_size_fails_the_invariant_naming_the_dimension():
    model, inputs, dynamic = causal_attention()
    with torch.no_grad():
        program = torch.export.export(model, inputs, dynamic_shapes=dynamic)
    (size,) = [d for n in program.graph.nodes if n.op == "placeholder" for d in n.meta["val"].shape
               if isinstance(d, torch.SymInt)]
    assert inv.dynamic_sizes_kept.check(AtenProgram(program)) is None
    int(size)  # what a backend's int(size) does: a guard that fixes the symbol at 8
    with pytest.raises(VerificationError) as error:
        inv.dynamic_sizes_kept.verify(AtenProgram(program), stage="dry_run")
    assert "ids's dim 1" in str(error.value) and "now 8" in str(error.value)


def test_a_dynamic_size_without_a_maximum_is_refused_at_capture():
    """ExecuTorch plans each tensor's memory at its size's upper bound, and at the example's size
    when there is none: such a program refuses longer inputs (set_inputs() error 0x10)."""
    model, inputs, _ = causal_attention()
    with pytest.raises(UserInputError) as error:
        compiler.compile(model, inputs, "portable", dynamic_shapes=({1: torch.export.Dim("seq", min=2)},))
    assert error.value.stage == "capture"
    assert "ids's dim 1" in error.value.reason and "no upper bound" in error.value.reason
    assert "max=" in error.value.hint
