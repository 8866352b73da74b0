"""Test-only switches that turn our MLX fixes off, to prove the check and `locate` catch their bugs.

Each fix below keeps stock ExecuTorch 1.5.1's MLX lowering from computing a silently wrong
number: a rewrite (`rewrites.py`) that gives its handler a call it lowers right, or a rule
(`support.py`, `arguments.py`) that keeps the call on the CPU. A rewrite whose leftovers (a
symbolic shape) a rule refuses is one fix with one switch, asked in both places: off, stock
lowers the call as it would. Tests turn one off with `fixes_off("clamp_input_cast_to_result")`;
the switching is `compiler.ir.fix_switches`, shared with the other backends.

Not switched, since without them stock fails loudly (an error at lowering or at run time, no
wrong number): `no_value_arguments_dropped`, `quantized_weights_mlx_cannot_hold_dequantized`,
`assertions_dropped` (keeps ops on MLX, fixes no value), and the rules `dtype_mlx_cannot_hold`,
`symbolic_float`, `integer_matmul_or_conv`, `dim_of_a_zero_d_tensor`, `pool_of_an_unbatched_input`,
`_dead_only_to_stock`, and handlers.py's handlers.
Nor `kept_dims_made_explicit` (argmax(dim=None, keepdim=True) 0-d): without it the program's
numbers still match eager here (its result leaves the payload in the shape the program declares),
so there is no wrong number to prove; nor `boolean_index`: stock's gather refuses a bool index
("[Gather] Boolean indices not supported").
"""

from __future__ import annotations

from compiler.ir import fix_switches

# Name -> what goes wrong without the fix.
FIXES: dict[str, str] = {
    "copy_source_like_destination": (
        "aten.copy returns its source unbroadcast and uncast (stock's handler emits contiguous(src)); "
        "with it the source is cast and expanded to the destination first, or the copy stays on the CPU "
        "(support.copy_source_unlike_destination)"
    ),
    "ignored_arguments_made_explicit": (
        "sort/argsort(descending=True) come back ascending, topk(largest=False) gives the largest "
        "(stock's handlers ignore the argument); with it they become an ascending sort flipped or cut, or "
        "stay on the CPU (arguments.ignored_argument)"
    ),
    "nearest_scales_torch_ignores_dropped": (
        "upsample_nearest2d steps by 1 / scale where torch copies or halves the index "
        "(scale 2.2 over 3 rows: rows 0,0,0,1,1,2 where torch reads 0,0,1,1,2,2)"
    ),
    "nearest_rows_unlike_torch": (
        "upsample_nearest2d whose source rows still differ from torch's (float64 against float32 "
        "rounding) stays on the CPU"
    ),
    "clamp_input_cast_to_result": (
        "clamp of an integer tensor by float bounds casts the bounds to the input's dtype "
        "(clamp(int x, min=0.5) gives 0 where torch gives 0.5)"
    ),
    "rms_norm_epsilon_made_explicit": (
        "rms_norm(eps=None) adds 1e-5 where torch adds finfo(dtype).eps (1.19e-7 for float32): rows of "
        "magnitude 1e-3 come out 5 % small"
    ),
    "same_rank_single_index": (
        "x[index] with an index of x's rank lowers to take_along_axis, an element-wise gather, "
        "instead of whole slices; the rule keeps it on the CPU"
    ),
    "integer_floor_division": (
        "integer floor division divides through mlx::divide, which returns float (7 // 2 gives 3.5); "
        "the rule keeps it on the CPU"
    ),
    "fractional_correction": (
        "var and std with a correction that is not a whole number take int(correction) as MLX's ddof "
        "(correction=0.5 computes correction=0); the rule keeps the call on the CPU"
    ),
    "repeat_interleave_flattened": (
        "repeat_interleave without a dim repeats along dim 0 where torch repeats the flattened input; "
        "the rule keeps the call on the CPU"
    ),
    "unwritten_output_read": (
        "max pooling's indices (and batch norm's saved statistics) are never written by stock's "
        "handler; the rule keeps a call whose other outputs are read on the CPU"
    ),
}

SWITCHES = fix_switches.register("mlx", FIXES)

# `on(name)` where a fix acts; `fixes_off(*names)`, for tests, compiles with those fixes off.
on = SWITCHES.on
fixes_off = SWITCHES.off
