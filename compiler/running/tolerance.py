"""The error a check accepts (light to import: the CLI's --help states the defaults)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    import torch

# The error `--check` accepts by default, by the precision the program computes in. A float32
# program is held to an absolute error; one computing in float16 (Core ML's default compute
# precision) or bfloat16 to a share of its largest expected output, as those keep about three
# and two decimal digits of any value: 1e-2 is ten times float16's resolution (2**-10), room
# for the rounding of a deep stack; 4e-2 five times bfloat16's (2**-7), as a bfloat16 program
# on the portable kernels rounds more intermediate results than eager torch does (an MLP's
# outputs 1.2% of the largest apart).
FLOAT32_ABSOLUTE = 1e-4
FLOAT16_OF_LARGEST = 1e-2
BFLOAT16_OF_LARGEST = 4e-2

# The explicit significand bits of the narrow floating dtypes: a value rounded to one is off by
# up to half a unit in the last place.
SIGNIFICAND_BITS = {"float16": 10, "bfloat16": 7}


def abs_error(got: "torch.Tensor", want: "torch.Tensor") -> "torch.Tensor":
    """|got - want| per element (float64, complex128 for complex values), where no NaN can hide a
    difference: equal values (the same infinity included) and NaN on both sides agree (0); a NaN
    on one side only, or two different infinities, are infinitely far off. Plain
    `(got - want).abs().max()` is NaN there, a NaN error compares as within any tolerance, and
    Python's max() drops it: a program returning NaN for a number passed with error 0."""
    import torch

    wide = torch.complex128 if got.is_complex() or want.is_complex() else torch.float64
    got, want = got.detach().to(wide), want.detach().to(wide)
    agree = (got == want) | (got.isnan() & want.isnan())
    return (got - want).abs().nan_to_num(nan=math.inf, posinf=math.inf).masked_fill(agree, 0.0)


def max_abs_error(got: "torch.Tensor", want: "torch.Tensor") -> float:
    """The largest `abs_error` (0 for empty tensors)."""
    return abs_error(got, want).max().item() if got.numel() else 0.0


def largest_finite(value: "torch.Tensor") -> float:
    """The largest finite |element| (0 for none): what a relative tolerance scales with; an
    infinity (a -inf mask) would make it infinite."""
    finite = value[value.isfinite()]
    return finite.abs().max().item() if finite.numel() else 0.0


def half_ulp(dtype: str, value: float) -> float:
    """Half a unit in the last place of `dtype` at `value`: the error of rounding to it (0 for a
    dtype not narrower than float32)."""
    bits = SIGNIFICAND_BITS.get(dtype)
    if bits is None or not value:
        return 0.0
    return math.ldexp(1.0, math.frexp(abs(value))[1] - 2 - bits)


@attrs.frozen
class Tolerance:
    """The largest absolute error a check accepts, and how it was chosen (said with the result)."""

    absolute: float
    rule: str
    # How many quantized activations the tolerance allows one step each (0: none).
    activation_quantizers: int = 0

    @classmethod
    def given(cls, absolute: float) -> "Tolerance":
        return cls(absolute, "absolute, as given")

    @classmethod
    def for_precision(cls, compute: str, largest_expected: float, by_delegate: bool = False) -> "Tolerance":
        """For a program computing in `compute` ("float32", "float16" or "bfloat16"); a float16
        precision `by_delegate` is a delegate's own compute precision."""
        if compute not in SIGNIFICAND_BITS:
            return cls(FLOAT32_ABSOLUTE, "absolute, for a program computing in float32")
        share = FLOAT16_OF_LARGEST if compute == "float16" else BFLOAT16_OF_LARGEST
        scale = largest_expected or 1.0
        return cls(
            share * scale,
            f"relative: {share:g} x the largest |eager output| {scale:.3g}, "
            f"for a {'delegate' if by_delegate else 'program'} computing in {compute}",
        )

    def with_output_rounding(self, dtype: str, largest_expected: float) -> "Tolerance":
        """Plus the rounding of outputs returned in a narrow dtype, at the largest value."""
        rounding = half_ulp(dtype, largest_expected)
        if not rounding:
            return self
        return Tolerance(
            self.absolute + rounding, f"{self.rule}; + {rounding:.3g}, half a {dtype} ulp at the largest output",
            self.activation_quantizers,
        )

    def with_activation_steps(self, deviation: float, quantizers: int, steps: tuple[float, float], draws: int) -> "Tolerance":
        """Plus what rounding each quantized activation one step otherwise does to the outputs, as
        another implementation of the same quantizers may (XNNPACK's own dynamic scales and rounding)."""
        return Tolerance(
            self.absolute + deviation,
            f"{self.rule}; + {deviation:.3g}, the largest change of the eager quantized model's outputs "
            f"with each of its {quantizers} activation quantizers' results moved one step (steps "
            f"{steps[0]:.3g} to {steps[1]:.3g}; random signs, {draws} draws)",
            quantizers,
        )
