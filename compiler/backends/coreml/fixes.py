"""Test-only switches that turn our Core ML fixes off, to prove the check catches their bugs.

Every fix below works around a coremltools conversion that is silently wrong (or, for
`never_alias`, a payload whose output is its input). Tests turn one off with
`fixes_off("tanh_gelu")`, compile, and show that running the program and comparing it
with eager fails; nothing else turns a fix off.

Each fix asks `on(name)` at the one place where it acts, when a node is converted or a
rule is asked, never when `conversion.installed()` builds the registry: the converter
registry is the same with a fix on or off, so switching cannot disturb its install and
restore counting. The switching itself (process-wide, counted, so nested or concurrent
blocks compose) is `compiler.ir.fix_switches`, shared with the other backends' fixes.
"""

from __future__ import annotations

from compiler.ir import fix_switches

# Name -> what the fix does (and so what goes wrong without it).
FIXES: dict[str, str] = {
    "tanh_gelu": (
        "gelu(approximate='tanh') converts as Core ML's TANH_APPROXIMATION "
        "(stock reads `approximate` positionally only and converts the exact GELU)"
    ),
    # One switch for every fill, nn.MultiheadAttention's bool mask included: its
    # `zeros_like(mask, dtype=float)` (stock: bool, as zeros_like reads its dtype positionally
    # only, so a functional masked_fill(-inf) then computes in bool and the mask adds 0/1) is
    # fixed by the same code as `full((n,), 2049)` (stock: float), in the same place. A second
    # switch would be a second name for that code. (MHA itself fills in place, which our
    # decomposition turns into `where`, which promotes the bool zeros: right either way.)
    "fill_dtypes": "fills convert with the dtype torch gives them (int, float for a bool mask's zeros_like)",
    "index_put_refusals": "index_put forms coremltools converts wrongly stay on the CPU (rules.unsupported_index_put)",
    "unary_epsilon": (
        "reciprocal, rsqrt and log convert without the epsilon Core ML adds by default "
        "(stock: 1 / x is 1/(x + 1e-4), 909 for 1000 at x = 1e-3)"
    ),
    "select_shape": (
        "where over a condition of a larger symbolic shape than its values is declared with the "
        "condition's shape (stock: the values' shape, 0-d for 0-d values)"
    ),
    "softplus_threshold": "softplus gives x where beta * x > threshold, as torch (stock drops the threshold)",
    "log_softmax": "log_softmax converts as x - max - log(sum(exp(x - max))) (stock: log(softmax(x)), -inf where softmax underflows)",
    "rms_norm_scaled_epsilon": (
        "rms_norm adds eps to the mean square of x as torch does (stock: to the mean square of x divided by "
        "its row's largest |x|, which is eps * max|x|^2: rows of magnitude 1e-3 come out 0.3 off)"
    ),
    "clamp_order": (
        "clamp by a bound known at run time converts as min(max(x, low), high), as torch (stock: "
        "max(min(x, high), low), which gives low where low > high)"
    ),
    "default_correction": (
        "var and std without a correction divide by n - 1, as torch (stock: by n, the population value)"
    ),
    "never_alias": "an op coremltools converts to its own input gets a real identity, so no output is an input",
}

SWITCHES = fix_switches.register("coreml", FIXES)

# `on(name)` where a fix acts; `fixes_off(*names)`, for tests, compiles with those fixes off.
on = SWITCHES.on
fixes_off = SWITCHES.off
