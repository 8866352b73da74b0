"""A NaN where eager has a number fails the check: `(got - want).abs().max()` is NaN there, a NaN
error compares as within any tolerance, and Python's max() drops it, so such a program passed
with "max abs error 0". The same infinity or NaN on both sides still agrees."""

import math

import torch

import compiler
from compiler.running.tolerance import abs_error


class Log(torch.nn.Module):
    def __init__(self, shift):
        super().__init__()
        self.shift = shift

    def forward(self, x):
        return torch.log(x - self.shift)


class Zero(torch.nn.Module):
    def forward(self, x):
        return x * 0


def test_a_nan_where_eager_has_a_number_fails_the_check():
    x = torch.rand(4)
    pte = compiler.compile(Log(10.0), (x,), "portable").pte  # log of a negative number: NaN
    check = compiler.compare_with_eager(pte, Zero(), (x,))
    assert not check.passed and check.max_abs_error == math.inf, check.describe()


def test_the_same_nan_or_infinity_on_both_sides_agrees():
    x = torch.tensor([0.5, 1.0, 2.0, 3.0])
    for shift in (1.0, 2.0):  # log(0) = -inf at one element; log of negatives: NaN
        model = Log(shift)
        check = compiler.compare_with_eager(compiler.compile(model, (x,), "portable").pte, model, (x,))
        assert check.passed and check.max_abs_error < 1e-6, check.describe()


def test_abs_error_per_element():
    inf, nan = math.inf, math.nan
    got = torch.tensor([1.0, -inf, nan, nan, inf, 2.0])
    want = torch.tensor([1.5, -inf, nan, 3.0, -inf, nan])
    assert abs_error(got, want).tolist() == [0.5, 0.0, 0.0, inf, inf, inf]


def test_an_infinite_output_does_not_make_a_relative_tolerance_infinite():
    class MaskedScores(torch.nn.Module):
        def forward(self, x):
            return x.masked_fill(x < 0, -math.inf)

    x = torch.tensor([-1.0, 0.5, 2.0, -3.0])
    pte = compiler.compile(MaskedScores(), (x,), "portable").pte
    check = compiler.compare_with_eager(pte, MaskedScores(), (x,))
    assert check.passed and check.largest_expected == 2.0
