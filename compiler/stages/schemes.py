"""The quantization schemes by name: what each quantizes, how, and for which backends.

Data only (no torch), so the CLI offers the names as choices before torch loads and the
docs' scheme table is generated from it. `compiler/stages/quantize.py` applies them; each
backend's entry in `compiler.ir.targets` says which it takes and names the ExecuTorch recipe
(`executorch.export`) that makes the same program, which the quantization benchmark and the
fuzzer compile beside ours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import attrs

from compiler.ir import targets
from compiler.ir.errors import UserInputError
from compiler.ir.targets import DYNAMIC, PER_CHANNEL, PER_GROUP, PER_TENSOR, PT2E, STATIC, TORCHAO, WEIGHT_ONLY

# How a scheme picks the weights' scales: one per output channel, one per group of
# `group_size` input channels of a row, or one for the whole tensor.
GRANULARITIES = (PER_CHANNEL, PER_GROUP, PER_TENSOR)

# What a scheme does to activations: nothing (WEIGHT_ONLY), quantized at run time from
# their own range (DYNAMIC), or with scales fixed by calibration (STATIC).

# The flows that apply a scheme (PT2E, TORCHAO): PT2E (export, prepare with a backend's
# quantizer, calibrate, convert) or a TorchAO config applied to the Linear (and Embedding) modules.

if TYPE_CHECKING:
    from compiler.stages.options import QuantizeOptions


@attrs.frozen
class Scheme:
    """A scheme by what it does; which backends take it, at which granularities, is each
    backend's entry in `compiler.ir.targets`."""

    name: str
    summary: str
    flow: str
    activations: str
    weight_bits: int

    @property
    def needs_calibration(self) -> bool:
        return self.activations == STATIC

    @property
    def backends(self) -> Mapping[str, Mapping[str, str | None]]:
        """Backend name -> the granularities it takes for this scheme (first: the default) and
        the ExecuTorch recipe per granularity that builds the same program."""
        return {t.name: t.schemes[self.name] for t in targets.TARGETS if self.name in t.schemes}

    def granularities(self, backend: str) -> tuple[str, ...]:
        return tuple(self.backends.get(backend, {}))

    def default_granularity(self, backend: str) -> str:
        return self.granularities(backend)[0]

    def recipe(self, backend: str, granularity: str) -> str | None:
        return self.backends.get(backend, {}).get(granularity)

    def why_not(self, backend: str, granularity: str | None = None) -> str:
        """Why the backend does not take this scheme (at this granularity), in one line."""
        target = targets.BY_NAME.get(backend)
        not_offered = target.not_offered if target else {}
        if granularity is not None and backend in self.backends:
            return not_offered.get(f"{self.name} {granularity}") or NOT_OFFERED.get(
                (self.flow, granularity), "ExecuTorch has no recipe for it, and it is not offered here")
        return not_offered.get(self.name) or not_offered.get(self.flow, "")


SCHEMES: tuple[Scheme, ...] = (
    Scheme("int8_dynamic", "int8 weights; activations quantized to int8 at run time (PT2E)", PT2E, DYNAMIC, 8),
    Scheme("int8_static", "int8 weights and activations, activation scales from calibration (PT2E)", PT2E, STATIC, 8),
    Scheme("int8_weight", "int8 weights, float activations (PT2E)", PT2E, WEIGHT_ONLY, 8),
    Scheme("8da4w", "int4 weights; activations quantized to int8 at run time (TorchAO)", TORCHAO, DYNAMIC, 4),
    Scheme("8da8w", "int8 weights; activations quantized to int8 at run time (TorchAO)", TORCHAO, DYNAMIC, 8),
    Scheme("4w", "int4 weights, float activations (TorchAO)", TORCHAO, WEIGHT_ONLY, 4),
    Scheme("8w", "int8 weights, float activations (TorchAO)", TORCHAO, WEIGHT_ONLY, 8),
    Scheme(
        "codebook", "weights as indices into a table of 2**bits values per block (palettization)", TORCHAO,
        WEIGHT_ONLY, 0,
    ),
)

BY_NAME: dict[str, Scheme] = {scheme.name: scheme for scheme in SCHEMES}
SCHEME_NAMES: tuple[str, ...] = tuple(BY_NAME)

# Embedding tables: weight-only TorchAO schemes, applied to nn.Embedding modules.
EMBEDDING_SCHEMES = ("4w", "8w")

# Why a flow's schemes are not offered at a granularity, where the backend does not say more.
NOT_OFFERED = {
    (PT2E, PER_GROUP): "PT2E's int8 quantizers scale weights per channel or per tensor",
    (TORCHAO, PER_TENSOR): "TorchAO's integer configs here scale weights per channel or per group",
}


def chosen_scheme(options: QuantizeOptions, backend: str) -> tuple[Scheme, str] | None:
    """The scheme and granularity `options` ask of `backend` (None: no quantization); a
    `UserInputError` for a scheme or granularity the backend does not take."""
    target = targets.BY_NAME.get(backend)  # None: a Backend object of the caller's, which takes no scheme
    no_tables = target.no_table_quantization if target else f"the {backend} backend is not in the targets table"
    if options.embedding is not None and no_tables:  # TorchAO's embedding ops, scheme or not
        takers = [t.name for t in targets.TARGETS if t.no_table_quantization is None]
        raise UserInputError(
            f"quantize_embedding on {backend}: {no_tables}", stage="quantize",
            hint=f"leave quantize_embedding out on {backend}, or compile for {', '.join(takers)}",
        )
    if options.scheme is None:
        return None
    scheme = BY_NAME[options.scheme]
    takes = scheme.granularities(backend)
    if not takes:
        fits = [s.name for s in SCHEMES if backend in s.backends]
        why = f": {scheme.why_not(backend)}" if scheme.why_not(backend) else ""
        raise UserInputError(
            f"the {backend} backend does not take the quantize scheme {scheme.name!r}{why}",
            stage="quantize",
            hint=f"for {backend} use one of: {', '.join(fits)}; {scheme.name} is for "
            f"{', '.join(scheme.backends)}",
        )
    granularity = options.granularity or scheme.default_granularity(backend)
    group_sizes = target.group_sizes if target else None
    if granularity == PER_GROUP and group_sizes and not group_sizes.allows(options.group_size):
        raise UserInputError(
            f"the {backend} backend takes group sizes that are {group_sizes.words}, not {options.group_size}",
            stage="quantize", hint=f"give a quantize_group_size that is {group_sizes.words}",
        )
    if granularity not in takes:
        raise UserInputError(
            f"the quantize scheme {scheme.name!r} on {backend} takes granularity {' or '.join(takes)}, "
            f"not {granularity}: {scheme.why_not(backend, granularity)}",
            stage="quantize",
            hint=f"give quantize_granularity {takes[0]}",
        )
    return scheme, granularity



def scheme_table() -> str:
    """The Markdown table of schemes (generated into docs/quantization.md)."""
    lines = [
        "| scheme | what it does | activations | backend: granularities (first: default) -> ExecuTorch recipe |",
        "|---|---|---|---|",
    ]
    for scheme in SCHEMES:
        cells = []
        for backend, recipes in scheme.backends.items():
            parts = [f"{g} -> `{r}`" if r else f"{g} (no recipe)" for g, r in recipes.items()]
            cells.append(f"**{backend}**: " + ", ".join(parts))
        lines.append(f"| `{scheme.name}` | {scheme.summary} | {scheme.activations} | {'; '.join(cells)} |")
    return "\n".join(lines)
