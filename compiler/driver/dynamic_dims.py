"""Dynamic input sizes as a user writes them: the one form of the CLI's `--dynamic-dim` (compile,
run) and of a sweep job's `dynamic_dim` key, parsed here once.

    INPUT:DIM:[MIN:]MAX   dimension DIM of input INPUT (forward's parameter name or position) takes
                          any size from MIN (default 1) to MAX, which ExecuTorch plans memory for
    INPUT:DIM=OTHER:DIM   dimension DIM of INPUT is the same size as OTHER's dimension DIM (one
                          `torch.export.Dim`, given its range by OTHER's own INPUT:DIM:[MIN:]MAX)

`compiler.api.dynamic_dims` makes them into torch.export's `dynamic_shapes`. Light to import (no
torch): the CLI checks the flags before torch loads.
"""

from __future__ import annotations

from typing import NamedTuple

from compiler.ir.errors import UserInputError

FORM = "INPUT:DIM:[MIN:]MAX"
TIED_FORM = "INPUT:DIM=OTHER:DIM"
HELP = (
    f"{FORM}: make dimension DIM of the model's input INPUT (forward's parameter name or position) dynamic, "
    "from MIN (default 1) to MAX, which ExecuTorch plans memory for; "
    f"{TIED_FORM}: the same size as OTHER's dimension DIM, one dynamic size for both (e.g. "
    "attention_mask:1=input_ids:1 with input_ids:1:2:32); repeat for more"
)


class DynamicDim(NamedTuple):
    """One dynamic size: `input`'s dimension `dim` from `min` (None: 1) to `max`, or, with
    `same_as` (input, dimension), that one's size (`max` None)."""

    input: str
    dim: int
    min: int | None = None
    max: int | None = None
    same_as: tuple[str, int] | None = None

    def __str__(self) -> str:
        if self.same_as is not None:
            return f"{self.input}:{self.dim}={self.same_as[0]}:{self.same_as[1]}"
        return f"{self.input}:{self.dim}:" + (f"{self.min}:" if self.min is not None else "") + str(self.max)


def _input_and_dim(text: str) -> tuple[str, int] | None:
    name, colon, dim = text.partition(":")
    if not (name and colon) or "=" in name:
        return None
    try:
        return name, int(dim)
    except ValueError:
        return None


def parse(text: str) -> DynamicDim:
    """`x:1:2:512` -> DynamicDim("x", 1, 2, 512); `x:1:512` -> DynamicDim("x", 1, None, 512);
    `mask:1=ids:1` -> DynamicDim("mask", 1, same_as=("ids", 1)). A `UserInputError` naming the form
    when `text` is neither."""
    tied, equals, other = text.partition("=")
    if equals:
        this, that = _input_and_dim(tied), _input_and_dim(other)
        if this is not None and that is not None:
            return DynamicDim(*this, same_as=that)
    else:
        parts = text.split(":")
        if len(parts) in (3, 4) and parts[0]:
            try:
                numbers = [int(p) for p in parts[1:]]
            except ValueError:
                pass
            else:
                return DynamicDim(parts[0], numbers[0], numbers[1] if len(numbers) == 3 else None, numbers[-1])
    raise UserInputError(
        f"{text!r} is neither {FORM} nor {TIED_FORM}",
        hint="e.g. x:1:2:512 (a dynamic size needs its maximum: ExecuTorch plans memory for it), or "
        "attention_mask:1=input_ids:1 for a size that is input_ids's",
    )
