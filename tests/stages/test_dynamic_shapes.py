"""A dynamic sequence dimension survives every stage that holds a program: each stage's output
still has the symbolic size on its input, and a stage (or a backend inside it) that fixes
the size fails the `dynamic_sizes_kept` invariant, naming the dimension, instead of handing
on a program that runs at the example's length only."""

import pytest
import torch

import compiler
from compiler.ir import invariants as inv
from compiler.ir.artifacts import AtenProgram
from compiler.ir.errors import VerificationError
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
