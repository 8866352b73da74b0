"""The backends by name: one entry each, with everything that identifies it.

Data only (no backend is imported here), so every layer may read it: the CLI lists the
backends before torch loads, the placement report names delegates as users know them,
the runtime finds who runs a payload. `compiler.backends` loads the packages.
"""

from __future__ import annotations

import attrs


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


TARGETS: tuple[Target, ...] = (
    Target("portable", "portable CPU", "compiler.backends.portable", "PortableBackend"),
    Target(
        "xnnpack", "XNNPACK", "compiler.backends.xnnpack", "XnnpackBackend", "XnnpackBackend",
        no_bfloat16="XNNPACK has no bfloat16 kernels",
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
    ),
    Target(
        "mlx", "MLX", "compiler.backends.mlx", "MLXBackend", "MLXBackend",
        "compiler.backends.mlx.reference:MLXDelegate",
        # Its payload's weights run as they are stored: a 3B Llama's 4w check added 1.9 GB for a
        # 2.6 GB program (Core ML's 4.5 GB for 1.2 GB: its MIL program unpacks 4-bit codes).
        reference_run_memory=1.5,
    ),
)

BY_NAME = {target.name: target for target in TARGETS}
BY_DELEGATE_ID = {target.delegate_id: target for target in TARGETS if target.delegate_id}
