"""The error a check accepts (light to import: the CLI's --help states the defaults)."""

from __future__ import annotations

import attrs

# The error `--check` accepts by default. A float32 program is held to an absolute error;
# a program that computes in float16 (Core ML's default compute precision) to a share of
# its largest expected output, as float16 keeps about three decimal digits of any value:
# 1e-2 is ten times float16's resolution (2**-10), room for the rounding of a deep stack.
FLOAT32_ABSOLUTE = 1e-4
FLOAT16_OF_LARGEST = 1e-2


@attrs.frozen
class Tolerance:
    """The largest absolute error a check accepts, and how it was chosen (said with the result)."""

    absolute: float
    rule: str

    @classmethod
    def given(cls, absolute: float) -> "Tolerance":
        return cls(absolute, "absolute, as given")

    @classmethod
    def for_precision(cls, float16: bool, largest_expected: float) -> "Tolerance":
        if not float16:
            return cls(FLOAT32_ABSOLUTE, "absolute, for a program computing in float32")
        scale = largest_expected or 1.0
        return cls(
            FLOAT16_OF_LARGEST * scale,
            f"relative: {FLOAT16_OF_LARGEST:g} x the largest |eager output| {scale:.3g}, "
            "for a delegate computing in float16",
        )
