"""The quantization schemes by name: what each quantizes, how, and for which backends.

Data only (no torch), so the CLI offers the names as choices before torch loads and the
docs' scheme table is generated from it. `compiler/stages/quantize.py` applies them; each
backend's entry names the ExecuTorch recipe (`executorch.export`) that makes the same
program, which the quantization benchmark and the fuzzer compile beside ours.
"""

from __future__ import annotations

from typing import Mapping

import attrs

# How a scheme picks the weights' scales: one per output channel, one per group of
# `group_size` input channels of a row, or one for the whole tensor.
PER_CHANNEL, PER_GROUP, PER_TENSOR = "per_channel", "per_group", "per_tensor"
GRANULARITIES = (PER_CHANNEL, PER_GROUP, PER_TENSOR)

# What a scheme does to activations: nothing (weight-only), quantized at run time from
# their own range (dynamic), or with scales fixed by calibration (static).
WEIGHT_ONLY, DYNAMIC, STATIC = "weight_only", "dynamic", "static"

# The flows that apply a scheme: PT2E (export, prepare with a backend's quantizer,
# calibrate, convert) or a TorchAO config applied to the Linear (and Embedding) modules.
PT2E, TORCHAO = "pt2e", "torchao"


@attrs.frozen
class Scheme:
    name: str
    summary: str
    flow: str
    activations: str
    weight_bits: int
    # Backend name -> the granularities it takes for this scheme (first: the default) and
    # the ExecuTorch recipe (`RecipeType` value) per granularity that builds the same program.
    backends: Mapping[str, Mapping[str, str | None]]
    # "backend" or "backend granularity" -> why that cell cannot exist, in one line (the
    # benchmark's table and the stage's refusal say it). A backend not named: `NOT_OFFERED`.
    not_offered: Mapping[str, str] = attrs.field(factory=dict)

    @property
    def needs_calibration(self) -> bool:
        return self.activations == STATIC

    def granularities(self, backend: str) -> tuple[str, ...]:
        return tuple(self.backends.get(backend, {}))

    def default_granularity(self, backend: str) -> str:
        return self.granularities(backend)[0]

    def recipe(self, backend: str, granularity: str) -> str | None:
        return self.backends.get(backend, {}).get(granularity)

    def why_not(self, backend: str, granularity: str | None = None) -> str:
        """Why the backend does not take this scheme (at this granularity)."""
        if granularity is not None and backend in self.backends:
            return self.not_offered.get(f"{backend} {granularity}") or NOT_OFFERED.get(
                (self.flow, granularity), "ExecuTorch has no recipe for it, and it is not offered here")
        return self.not_offered.get(backend) or NOT_OFFERED.get((self.flow, backend), "")


SCHEMES: tuple[Scheme, ...] = (
    Scheme(
        "int8_dynamic", "int8 weights; activations quantized to int8 at run time (PT2E)", PT2E, DYNAMIC, 8,
        {"xnnpack": {PER_CHANNEL: "xnnpack_pt2e_int8_dynamic_per_channel"}, "portable": {PER_CHANNEL: None}},
        {"coreml": "Core ML's quantizer quantizes activations statically only (int8_static)"},
    ),
    Scheme(
        "int8_static", "int8 weights and activations, activation scales from calibration (PT2E)", PT2E, STATIC, 8,
        {
            "xnnpack": {
                PER_CHANNEL: "xnnpack_pt2e_int8_static_per_channel",
                PER_TENSOR: "xnnpack_pt2e_int8_static_per_tensor",
            },
            "coreml": {PER_CHANNEL: "coreml_pt2e_int8_static"},
            "portable": {PER_CHANNEL: None, PER_TENSOR: None},
        },
        {"coreml per_tensor": "ExecuTorch's Core ML quantizer makes per-channel weight scales only"},
    ),
    Scheme(
        "int8_weight", "int8 weights, float activations (PT2E)", PT2E, WEIGHT_ONLY, 8,
        {"coreml": {PER_CHANNEL: "coreml_pt2e_int8_weight_only"}},
        {
            "xnnpack": "XNNPACK's int8 weights come with int8 activations: int8_dynamic, 8da8w",
            "portable": "weight-only PT2E is Core ML's quantizer's mode; portable takes int8_dynamic, int8_static",
            "coreml per_tensor": "ExecuTorch's Core ML quantizer makes per-channel weight scales only",
        },
    ),
    Scheme(
        "8da4w", "int4 weights; activations quantized to int8 at run time (TorchAO)", TORCHAO, DYNAMIC, 4,
        {
            "xnnpack": {
                PER_GROUP: "xnnpack_torchao_int8da_int4w_per_tensor",  # ExecuTorch's name; it is per group
                PER_CHANNEL: "xnnpack_torchao_int8da_int4w_per_channel",
            }
        },
        {"coreml": "Core ML quantizes activations statically only: 4w keeps them in float",
         "mlx": "MLX's quantized matmul takes float activations: 4w"},
    ),
    Scheme(
        "8da8w", "int8 weights; activations quantized to int8 at run time (TorchAO)", TORCHAO, DYNAMIC, 8,
        {"xnnpack": {PER_CHANNEL: None}},
        {"xnnpack per_group": "XNNPACK's lowering: \"Only 4b group quantization is supported\"",
         "coreml": "Core ML quantizes activations statically only: 8w keeps them in float",
         "mlx": "MLX's quantized matmul takes float activations: 8w"},
    ),
    Scheme(
        "4w", "int4 weights, float activations (TorchAO)", TORCHAO, WEIGHT_ONLY, 4,
        {
            "coreml": {
                PER_GROUP: "coreml_torchao_int4_weight_only_per_group",
                PER_CHANNEL: "coreml_torchao_int4_weight_only_per_channel",
            },
            "mlx": {PER_GROUP: None, PER_CHANNEL: None},
        },
        {"xnnpack": "XNNPACK's 4-bit kernels quantize activations at run time: 8da4w"},
    ),
    Scheme(
        "8w", "int8 weights, float activations (TorchAO)", TORCHAO, WEIGHT_ONLY, 8,
        {
            "coreml": {
                PER_CHANNEL: "coreml_torchao_int8_weight_only_per_channel",
                PER_GROUP: "coreml_torchao_int8_weight_only_per_group",
            },
            "mlx": {PER_GROUP: None, PER_CHANNEL: None},
        },
        {"xnnpack": "XNNPACK's int8 weights come with int8 activations: int8_dynamic, 8da8w"},
    ),
    Scheme(
        "codebook", "weights as indices into a table of 2**bits values per block (palettization)", TORCHAO,
        WEIGHT_ONLY, 0, {"coreml": {PER_GROUP: "coreml_codebook_weight_only"}},
        {"coreml per_channel": "a codebook's table is per block of group_size columns (per_group)",
         "coreml per_tensor": "a codebook's table is per block of group_size columns (per_group)"}
        | {backend: "lookup-table weights are a Core ML format (constexpr_lut_to_dense)" for backend in ("xnnpack", "mlx")},
    ),
)


# Backend -> (whether it takes a group size, the rule in words): XNNPACK's lowering asserts
# "group_size to be a multiple of 32"; MLX's quantized kernels take 32, 64 and 128.
GROUP_SIZES = {
    "xnnpack": (lambda size: size % 32 == 0, "a multiple of 32"),
    "mlx": (lambda size: size in (32, 64, 128), "32, 64 or 128"),
}

BY_NAME: dict[str, Scheme] = {scheme.name: scheme for scheme in SCHEMES}
SCHEME_NAMES: tuple[str, ...] = tuple(BY_NAME)

# Embedding tables: weight-only TorchAO schemes, applied to nn.Embedding modules.
EMBEDDING_SCHEMES = ("4w", "8w")

# The portable CPU runtime runs PT2E's int8 programs with ExecuTorch's quantized kernels
# (quantize, dequantize, choose_qparams: `compiler.ir.kernels.load_quantized_kernels`), but
# has no kernel for TorchAO's ops (torchao::dequantize_affine, ...).
PORTABLE_ANSWER = (
    "the portable CPU runtime has ExecuTorch's quantized kernels for PT2E's int8 schemes "
    "(int8_dynamic, int8_static: quantize and dequantize on the CPU around float ops), and no kernel "
    "for TorchAO's ops: the TorchAO schemes are for xnnpack, coreml and mlx"
)

# Why a flow's schemes are not on a backend, where the scheme does not say more.
NOT_OFFERED = {
    (PT2E, "mlx"): "the MLX delegate lowers TorchAO's weight-only codes (4w, 8w), not PT2E's quantize/dequantize pairs",
    (TORCHAO, "portable"): PORTABLE_ANSWER,
    (PT2E, PER_GROUP): "PT2E's int8 quantizers scale weights per channel or per tensor",
    (TORCHAO, PER_TENSOR): "TorchAO's integer configs here scale weights per channel or per group",
}


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
