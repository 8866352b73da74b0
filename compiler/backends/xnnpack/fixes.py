"""Test-only switches that turn our XNNPACK fixes off, to prove the check and `locate` catch their bugs.

Each fix below keeps stock XNNPACK 1.5.1 from computing a silently wrong number (`rules.py`):
a rewrite into ops it lowers right, or a refusal that keeps the node on the CPU. Tests turn one
off with `fixes_off("tanh_gelu_as_plain_ops")`; the switching is `compiler.ir.fix_switches`,
shared with the other backends.

Not switched, since without them stock fails loudly (an assertion or error at lowering, or a
refusal), with no wrong number: `refuse_eight_bit_groups`, `hardtanh_bounds_spelled_out`,
`copies_leaving_the_delegate`, and the refusals `max_dim_stock_cannot_pool`, `nhwc_op_not_4d`,
`reads_a_dynamic_size` and `llm_custom_op`.
"""

from __future__ import annotations

from compiler.ir import fix_switches

# Name -> what goes wrong without the fix.
FIXES: dict[str, str] = {
    "tanh_gelu_as_plain_ops": (
        "gelu(approximate='tanh') runs as XNNPACK's exact GELU (its visitor passes no mode), up to 4.7e-4 off"
    ),
    "dequantize_with_plain_ops": (
        "a weight-only quantized linear's dequantize_affine is dropped with its scales: the GEMM "
        "computes x @ qdata.T"
    ),
    "addmm_scaled": "addmm(beta, alpha) computes bias + input @ weight (the visitor ignores beta and alpha)",
    "bilinear_scale_unlike_size": (
        "upsample_bilinear2d given scale_factors whose output size is not in * scale samples at "
        "in / out steps, torch at 1 / scale"
    ),
}

SWITCHES = fix_switches.register("xnnpack", FIXES)

# `on(name)` where a fix acts; `fixes_off(*names)`, for tests, compiles with those fixes off.
on = SWITCHES.on
fixes_off = SWITCHES.off
