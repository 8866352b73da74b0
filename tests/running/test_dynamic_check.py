"""The check of a program with a dynamic dimension runs it at the bottom and the top of the
declared range too, not only at the example's size, and reports the worst."""

import attrs
import pytest
import torch

import compiler
from compiler.ir.errors import UserInputError
from compiler.running.runtime import compare_with_eager
from dynamic_shape_models import causal_attention


def test_check_runs_at_the_ends_of_the_range():
    model, inputs, dynamic = causal_attention()
    result = compiler.compile(model, inputs, "portable", dynamic_shapes=dynamic)
    check = compare_with_eager(result, model, inputs)
    assert check.passed, check.describe()
    assert check.sizes == ("ids's dim 1 = 2", "ids's dim 1 = 32")
    assert "also at ids's dim 1 = 2, ids's dim 1 = 32" in check.describe()
    assert check.to_json()["sizes"] == ["ids's dim 1 = 2", "ids's dim 1 = 32"]


def test_a_program_wrong_at_another_size_fails_the_check():
    """A program compiled without the dynamic dimension, checked as if it had it, is what a
    size fixed by a dependency looks like: right at the example's size only."""
    model, inputs, dynamic = causal_attention()
    result = compiler.compile(model, inputs, "portable", dynamic_shapes=dynamic)
    static = compiler.compile(model, inputs, "portable")
    posing = attrs.evolve(result, artifact=static.artifact)
    check = compare_with_eager(posing, model, inputs)
    assert not check.passed
    assert "ids's dim 1 = 2" in check.describe()


def test_a_pte_alone_is_checked_at_the_example_size():
    model, inputs, dynamic = causal_attention()
    result = compiler.compile(model, inputs, "portable", dynamic_shapes=dynamic)
    assert compare_with_eager(result.pte, model, inputs).sizes == ()


@pytest.mark.parametrize("backend", ["portable", "mlx"])
def test_an_input_above_the_range_is_refused_by_name(backend):
    """ExecuTorch's runtime says 'set_inputs() failed with error 0x10', the reference executor
    'Trying to resize storage that is not resizable'."""
    model, inputs, dynamic = causal_attention()
    result = compiler.compile(model, inputs, backend, dynamic_shapes=dynamic)
    with pytest.raises(UserInputError, match=r"input 0 of forward has size 40 in dimension 1, above the program's 32"):
        compiler.run(result, (torch.randint(0, 40, (1, 40)),))
    with pytest.raises(UserInputError, match=r"input 0 of forward has 3 dimensions; the program takes 2"):
        compiler.run(result, (torch.randint(0, 40, (1, 4, 2)),))
