"""The backends by name: one entry each, with everything that identifies it.

Data only (no backend is imported here), so every layer may read it: the CLI lists the
backends before torch loads, the placement report names delegates as users know them,
the runtime finds who runs a payload. `compiler.backends` loads the packages.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

# The granularities and flows the quantization schemes use (`compiler.stages.schemes`).
PER_CHANNEL, PER_GROUP, PER_TENSOR = "per_channel", "per_group", "per_tensor"
PT2E, TORCHAO = "pt2e", "torchao"
WEIGHT_ONLY, DYNAMIC, STATIC = "weight_only", "dynamic", "static"


@attrs.frozen
class GroupSizes:
    """The group sizes a backend's grouped kernels take: a multiple of `multiple_of`, or one of `one_of`."""

    multiple_of: int | None = None
    one_of: tuple[int, ...] = ()

    def allows(self, size: int) -> bool:
        if self.one_of:
            return size in self.one_of
        return self.multiple_of is None or size % self.multiple_of == 0

    @property
    def words(self) -> str:
        if self.one_of:
            return ", ".join(map(str, self.one_of[:-1])) + f" or {self.one_of[-1]}"
        return f"a multiple of {self.multiple_of}"


@attrs.frozen
class Target:
    name: str  # as the API and the CLI take it
    display_name: str  # as reports say it
    package: str  # the backend's package, in compiler.backends
    class_name: str  # its Backend class there
    # The id its payloads carry in a .pte (None: it makes no delegate).
    delegate_id: str | None = None
    # The class (in its package, "module:Class") that runs its payloads in the reference
    # executor when the pip runtime lacks the delegate: `Runner(payload: bytes, executor)`
    # once per delegate, with `.graph_inputs` and `.execute(inputs) -> outputs` per call.
    reference_runner: str | None = None
    # Where its payloads run, for the error a machine that cannot run them gives.
    runs_on: str | None = None
    # Why its delegate computes no bfloat16 (None: it does): there precision `auto` computes
    # a bfloat16 program in float32.
    no_bfloat16: str | None = None
    # The floating precision its delegate computes in when its compile specs leave it out
    # (None: each node's own dtype).
    default_compute_precision: str | None = None
    # What lowering to it holds at its peak besides the program, per byte of the model's weights in
    # float32 (measured on a 0.5B Llama, `benchmarks/scale.py`): the memory check's estimate.
    lowering_memory: float = 0.5
    # What running its payloads in the reference runner holds, per byte of the program: the
    # check's estimate before it loads one (the bytes read, each payload's copy, its weights decoded).
    reference_run_memory: float = 4.0
    # The installed packages (besides torch and ExecuTorch) that decide what its programs are.
    dependencies: tuple[str, ...] = ()
    # Quantization: scheme name -> the granularities it takes for that scheme (first: the default),
    # each with the ExecuTorch recipe (`RecipeType` value) that builds the same program, or None.
    schemes: Mapping[str, Mapping[str, str | None]] = attrs.field(factory=dict)
    # Why a scheme ("int8_weight"), a scheme at a granularity ("int8_static per_tensor") or a
    # whole flow ("pt2e") is not offered here, in one line, where the scheme does not say more.
    not_offered: Mapping[str, str] = attrs.field(factory=dict)
    # The group sizes its per-group kernels take (None: any the model's rows divide into).
    group_sizes: GroupSizes | None = None
    # Why it takes no quantized Embedding tables (None: it takes them).
    no_table_quantization: str | None = None
    # The backend options a program that keeps state between calls (a KV cache) needs, and those
    # a program whose methods share that state needs besides.
    stateful_options: Mapping[str, Any] = attrs.field(factory=dict)
    shared_state_options: Mapping[str, Any] = attrs.field(factory=dict)
    # Stock ExecuTorch's partitioner for it ("module:Class", None: it has none) and the package
    # that registers its `executorch.export` recipes: the stock path the fuzzer and locate rebuild.
    stock_partitioner: str | None = None
    recipes_package: str | None = None
    # Whether its payloads keep the names of the Edge nodes they were made from (else locate
    # reads a payload's values through the rebuilt delegate's program).
    payload_keeps_node_names: bool = False


# The portable CPU runtime runs PT2E's int8 programs with ExecuTorch's quantized kernels
# (quantize, dequantize, choose_qparams: `compiler.ir.kernels.load_quantized_kernels`), but
# has no kernel for TorchAO's ops (torchao::dequantize_affine, ...).
PORTABLE_ANSWER = (
    "the portable CPU runtime has ExecuTorch's quantized kernels for PT2E's int8 schemes "
    "(int8_dynamic, int8_static: quantize and dequantize on the CPU around float ops), and no kernel "
    "for TorchAO's ops: the TorchAO schemes are for xnnpack, coreml and mlx"
)
CORE_ML_PER_CHANNEL_ONLY = "ExecuTorch's Core ML quantizer makes per-channel weight scales only"
LOOKUP_TABLES = "lookup-table weights are a Core ML format (constexpr_lut_to_dense)"
INT8_NEEDS_INT8_ACTIVATIONS = "XNNPACK's int8 weights come with int8 activations: int8_dynamic, 8da8w"


TARGETS: tuple[Target, ...] = (
    Target(
        "portable", "portable CPU", "compiler.backends.portable", "PortableBackend",
        schemes={"int8_dynamic": {PER_CHANNEL: None}, "int8_static": {PER_CHANNEL: None, PER_TENSOR: None}},
        not_offered={
            "int8_weight": "weight-only PT2E is Core ML's quantizer's mode; portable takes int8_dynamic, int8_static",
            TORCHAO: PORTABLE_ANSWER,
        },
        no_table_quantization=PORTABLE_ANSWER,
    ),
    Target(
        "xnnpack", "XNNPACK", "compiler.backends.xnnpack", "XnnpackBackend", "XnnpackBackend",
        no_bfloat16="XNNPACK has no bfloat16 kernels",
        schemes={
            "int8_dynamic": {PER_CHANNEL: "xnnpack_pt2e_int8_dynamic_per_channel"},
            "int8_static": {
                PER_CHANNEL: "xnnpack_pt2e_int8_static_per_channel",
                PER_TENSOR: "xnnpack_pt2e_int8_static_per_tensor",
            },
            "8da4w": {
                PER_GROUP: "xnnpack_torchao_int8da_int4w_per_tensor",  # ExecuTorch's name; it is per group
                PER_CHANNEL: "xnnpack_torchao_int8da_int4w_per_channel",
            },
            "8da8w": {PER_CHANNEL: None},
        },
        not_offered={
            "int8_weight": INT8_NEEDS_INT8_ACTIVATIONS,
            "8da8w per_group": "XNNPACK's lowering: \"Only 4b group quantization is supported\"",
            "4w": "XNNPACK's 4-bit kernels quantize activations at run time: 8da4w",
            "8w": INT8_NEEDS_INT8_ACTIVATIONS,
            "codebook": LOOKUP_TABLES,
        },
        # XNNPACK's lowering asserts "group_size to be a multiple of 32".
        group_sizes=GroupSizes(multiple_of=32),
        stock_partitioner="executorch.backends.xnnpack.partition.xnnpack_partitioner:XnnpackPartitioner",
        recipes_package="executorch.backends.xnnpack.recipes",
    ),
    Target(
        "coreml", "Core ML", "compiler.backends.coreml", "CoreMLBackend", "CoreMLBackend",
        "compiler.backends.coreml.reference:CoreMLDelegate",
        "an Apple device (macOS, iOS) whose ExecuTorch runtime is built with the Core ML delegate",
        no_bfloat16="Core ML takes no bfloat16 (it computes a float32 program in its compute precision, "
        "float16 by default)",
        default_compute_precision="float16",
        # coremltools' conversion (it holds the weights as numpy arrays, then their float16 or
        # palettized forms, the .mlpackage and the flattened payload), with its float16 overflow test
        # made piecewise: 1.65x the float32 weights for float and 0.71x for 4w at 0.5B, 1.03x and
        # 0.13x at 1B (it was 2.7x and 3.1x before); 2.0 keeps a margin.
        lowering_memory=2.0,
        # Measured: a 1B Llama's 4w program (1.22 GB) added 4.5 GB at its float16 check.
        reference_run_memory=4.0,
        dependencies=("coremltools",),
        schemes={
            "int8_static": {PER_CHANNEL: "coreml_pt2e_int8_static"},
            "int8_weight": {PER_CHANNEL: "coreml_pt2e_int8_weight_only"},
            "4w": {
                PER_GROUP: "coreml_torchao_int4_weight_only_per_group",
                PER_CHANNEL: "coreml_torchao_int4_weight_only_per_channel",
            },
            "8w": {
                PER_CHANNEL: "coreml_torchao_int8_weight_only_per_channel",
                PER_GROUP: "coreml_torchao_int8_weight_only_per_group",
            },
            "codebook": {PER_GROUP: "coreml_codebook_weight_only"},
        },
        not_offered={
            "int8_dynamic": "Core ML's quantizer quantizes activations statically only (int8_static)",
            "int8_static per_tensor": CORE_ML_PER_CHANNEL_ONLY,
            "int8_weight per_tensor": CORE_ML_PER_CHANNEL_ONLY,
            "8da4w": "Core ML quantizes activations statically only: 4w keeps them in float",
            "8da8w": "Core ML quantizes activations statically only: 8w keeps them in float",
            "codebook per_channel": "a codebook's table is per block of group_size columns (per_group)",
            "codebook per_tensor": "a codebook's table is per block of group_size columns (per_group)",
        },
        # Core ML keeps a KV cache as its own state from iOS 18; state the methods share stays the
        # program's (a Core ML state would be one method's own).
        stateful_options={"minimum_deployment_target": "iOS18"},
        shared_state_options={"take_over_mutable_buffer": False},
        stock_partitioner="executorch.backends.apple.coreml.partition:CoreMLPartitioner",
        recipes_package="executorch.backends.apple.coreml.recipes",
        payload_keeps_node_names=True,
    ),
    Target(
        "mlx", "MLX", "compiler.backends.mlx", "MLXBackend", "MLXBackend",
        "compiler.backends.mlx.reference:MLXDelegate",
        # Its payload's weights run as they are stored: a 3B Llama's 4w check added 1.9 GB for a
        # 2.6 GB program (Core ML's 4.5 GB for 1.2 GB: its MIL program unpacks 4-bit codes).
        reference_run_memory=1.5,
        dependencies=("mlx",),
        schemes={"4w": {PER_GROUP: None, PER_CHANNEL: None}, "8w": {PER_GROUP: None, PER_CHANNEL: None}},
        not_offered={
            "8da4w": "MLX's quantized matmul takes float activations: 4w",
            "8da8w": "MLX's quantized matmul takes float activations: 8w",
            "codebook": LOOKUP_TABLES,
            PT2E: "the MLX delegate lowers TorchAO's weight-only codes (4w, 8w), not PT2E's quantize/dequantize pairs",
        },
        # MLX's quantized kernels take these group sizes.
        group_sizes=GroupSizes(one_of=(32, 64, 128)),
        stock_partitioner="executorch.backends.mlx.partitioner:MLXPartitioner",
    ),
)

BY_NAME = {target.name: target for target in TARGETS}
# The backend the API and the CLI compile for when none is named: every op on the CPU.
DEFAULT = TARGETS[0].name
# The one that delegates nothing: how a program without delegates is named.
NO_DELEGATE = next(target.name for target in TARGETS if target.delegate_id is None)
BY_DELEGATE_ID = {target.delegate_id: target for target in TARGETS if target.delegate_id}
