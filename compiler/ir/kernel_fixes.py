"""Test-only switches that let a known-wrong portable CPU kernel through, to prove the check
and `locate` catch it.

`kernels.WRONG_KERNELS` lists the runtime's CPU kernels that compute otherwise than torch;
the decompose stage rewrites such calls into ops whose kernels agree, and the
`cpu_ops_have_kernels` invariant refuses one left on the CPU. Switched off (`fixes_off(name)`),
both let the call through to the wrong kernel. The switching is `compiler.ir.fix_switches`,
shared with the backends' fixes.

Not switched: the kernel limits (`kernel_limits.py`) and their rewrites
(`compiler/passes/cpu_rewrites.py`). Without them the portable kernel refuses the call when the
program runs (or, for a 0-d sum, aborts the process): a loud failure, no wrong number.
"""

from __future__ import annotations

from compiler.ir import fix_switches

# Name -> what goes wrong without the fix.
FIXES: dict[str, str] = {
    "integer_remainder": (
        "integer remainder runs the portable kernel, which truncates like C's % where torch floors "
        "(-2 % 5 gives -2, torch 3); with the fix it becomes a - floor_div(a, b) * b"
    ),
    "half_precision_accumulation": (
        "float16 and bfloat16 layer_norm, var and cumsum run the portable kernels, which accumulate in the "
        "input's precision (a float16 layer norm over 2048 values came out 0.96 of its largest output off); "
        "with the fix they compute in float32 and cast back, as torch's kernels do"
    ),
}

SWITCHES = fix_switches.register("cpu_kernels", FIXES)

# `on(name)` where a fix acts; `fixes_off(*names)`, for tests, compiles with those fixes off.
on = SWITCHES.on
fixes_off = SWITCHES.off
