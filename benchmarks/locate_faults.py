"""Real faults, one per fix switch, and where `compiler.locate` puts them (issue 31, item 4).

    python -m benchmarks.locate_faults [--only ID ...] [--markdown FILE] [--json FILE]

Each of our fixes for something stock lowers, converts or computes silently wrong has a
test-only switch (`compiler.ir.fix_switches`: the Core ML conversion fixes, the MLX rewrites and
refusals, the XNNPACK rewrites and refusals, the wrong portable CPU kernels). For each switch
`CASES` holds a small model that needs the fix. With the fix switched off, each case is compiled
(without verify-each, so the wrong program is what runs), compared with eager
(`compare_with_eager`: it must fail, or refuse to run the payload), and located
(`compiler.locate_result` on that compile, what `compiler.locate` runs after compiling; inside
the switch, as a cut of the delegate lowers again). The row says the stage and node `locate`
named, the node the fix exists for, and the seconds `locate` took (`Location.seconds`, the
compile not counted).

Writes `benchmarks/results/locate_faults.md` and `.json`. `tests/test_locate_faults.py` runs the
same cases (`outcome`), one per backend in the default run, the rest with -m slow; a case whose
node `locate` cannot name yet says why (`Case.xfail`), and its test is a strict xfail.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import os
import platform
import time
import warnings
from typing import Any, Callable

warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")  # coremltools' progress bars
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
logging.getLogger("coremltools").setLevel(logging.ERROR)

import attrs  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

RESULTS = os.path.join(os.path.dirname(__file__), "results")
DEFAULT_MARKDOWN = os.path.join(RESULTS, "locate_faults.md")
DEFAULT_JSON = os.path.join(RESULTS, "locate_faults.json")

# Owner of the switches -> (the module declaring its FIXES, the backend its cases compile for).
OWNERS = {
    "coreml": ("compiler.backends.coreml.fixes", "coreml"),
    "mlx": ("compiler.backends.mlx.fixes", "mlx"),
    "xnnpack": ("compiler.backends.xnnpack.fixes", "xnnpack"),
    "cpu_kernels": ("compiler.ir.kernel_fixes", "portable"),
}
FP32 = {"compute_precision": "float32"}  # Core ML: faults below float16's resolution show at float32


class Fn(nn.Module):
    """A module computing `fn` of its inputs (each case scales its input first, so the fault's
    op reads a computed value, not a program input)."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


class LinearGelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.g, self.b = nn.Linear(16, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(self.g(self.a(x)))


class IntFill(nn.Module):
    """Token ids offset by a fill above 2**24: stock fills float32, which loses the odd ones."""

    def forward(self, ids):
        return torch.full((1, 16), 2**24 + 1) + ids


class MaskedScores(nn.Module):
    """nn.MultiheadAttention's additive mask written out: stock fills its zeros as bool."""

    def forward(self, q, k, mask):
        additive = torch.zeros_like(mask, dtype=q.dtype).masked_fill(mask, float("-inf"))
        return (q @ k.transpose(-1, -2) / 2 + additive).softmax(-1)


class MaskOverPickedRows(nn.Module):
    def forward(self, x, keep):
        rows = x[keep]
        later = rows[:, None, :, None] > rows[:, None, None, :]
        return torch.where(later, 0.0, float("-inf")) + rows[:, None, None, :]


class ScaledAddmm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bias, self.weight = nn.Parameter(torch.randn(8)), nn.Parameter(torch.randn(5, 8))

    def forward(self, x):
        return torch.addmm(self.bias, x * 2, self.weight, beta=0.5, alpha=2.0) + 1


def _seeded(build: Callable[[], tuple]) -> Callable[[], tuple]:
    @functools.wraps(build)
    def seeded():
        torch.manual_seed(0)
        model, inputs = build()
        return model.eval(), inputs

    return seeded


def _weight_only_linear():
    from torchao.quantization.granularity import PerAxis
    from torchao.quantization.quant_api import IntxWeightOnlyConfig, quantize_

    model = nn.Sequential(nn.Linear(64, 16)).eval()
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0)))
    return model, (torch.randn(3, 64),)


@attrs.frozen(eq=False)
class Case:
    """One fault: the switch turned off, the model that needs the fix, and where locate should
    put it (the stage, and the node the fix exists for: its name and op)."""

    owner: str
    switch: str
    build: Callable[[], tuple]
    node: str
    op: str
    stage: str = "lower"
    options: dict | None = None
    label: str = ""  # tells two cases of one switch apart
    default: bool = False  # in the default test run (one per backend)
    raises: bool = False  # the check refuses to run the fix-off program (instead of a wrong number)
    xfail: str | None = None  # why locate cannot name the node yet

    @property
    def id(self) -> str:
        return f"{self.owner}.{self.switch}" + (f"-{self.label}" if self.label else "")

    @property
    def backend(self) -> str:
        return OWNERS[self.owner][1]

    def switches(self):
        return importlib.import_module(OWNERS[self.owner][0]).SWITCHES

    def what(self) -> str:
        return self.switches().fixes[self.switch]


CASES: tuple[Case, ...] = (
    # --- Core ML conversion fixes (compiler/backends/coreml/conversion.py, rules.py) ---------------
    Case("coreml", "tanh_gelu", _seeded(lambda: (LinearGelu(), (torch.randn(4, 16) * 3,))),
         "aten_gelu_default", "aten.gelu.default", options=FP32),
    Case("coreml", "fill_dtypes", _seeded(lambda: (IntFill(), (torch.arange(16).reshape(1, 16),))),
         "aten_full_default", "aten.full.default", options=FP32, label="int-fill"),
    Case("coreml", "fill_dtypes",
         _seeded(lambda: (MaskedScores(), (torch.randn(1, 4, 8), torch.randn(1, 4, 8),
                                           torch.triu(torch.ones(4, 4, dtype=torch.bool), 1)))),
         "aten_zeros_like_default", "aten.zeros_like.default", options=FP32, label="bool-mask"),
    Case("coreml", "unary_epsilon", _seeded(lambda: (Fn(lambda x: 1 / (x * 2) + 1), (torch.tensor([[1e-3, 0.5, 2.0, -0.01]]),))),
         "aten_reciprocal_default", "aten.reciprocal.default", options=FP32, default=True),
    Case("coreml", "softplus_threshold",
         _seeded(lambda: (Fn(lambda x: F.softplus(x * 2, beta=2.0, threshold=5.0) + 1), (torch.tensor([[1.2, 1.3, 1.5, -0.5]]),))),
         "aten_softplus_default", "aten.softplus.default", options=FP32),
    Case("coreml", "log_softmax",
         _seeded(lambda: (Fn(lambda x: torch.log_softmax(x * 2, -1) + 1), (torch.tensor([[0.0, -2.5, -10.0, -100.0]]),))),
         "aten_log_softmax_int", "aten.log_softmax.int", options=FP32),
    Case("coreml", "rms_norm_scaled_epsilon",
         _seeded(lambda: (Fn(lambda x: F.rms_norm(x * 2, (4,), None, eps=1e-6) + 1), (torch.randn(2, 4) * 1e-3,))),
         "aten_rms_norm_default", "aten.rms_norm.default", options=FP32),
    Case("coreml", "select_shape",
         _seeded(lambda: (MaskOverPickedRows(), (torch.randn(6, 16), torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)))),
         "aten_where_self", "aten.where.self", raises=True),
    Case("coreml", "clamp_order",
         _seeded(lambda: (Fn(lambda x, low, high: torch.clamp(x * 2, low, high) + 1),
                          (torch.randn(2, 4), torch.randn(2, 4) + 1, torch.randn(2, 4) - 1))),
         "aten_clamp_tensor", "aten.clamp.Tensor", options=FP32),
    Case("coreml", "default_correction", _seeded(lambda: (Fn(lambda x: torch.std(x * 2) + 1), (torch.randn(2, 4),))),
         "aten_std_correction", "aten.std.correction", options=FP32),
    Case("coreml", "never_alias", _seeded(lambda: (Fn(lambda x: (x.clone(), x + 1)), (torch.randn(3),))),
         "dim_order_ops__clone_dim_order_default", "dim_order_ops._clone_dim_order.default", options=FP32, raises=True),
    # --- MLX rewrites and refusals (compiler/backends/mlx/rewrites.py, support.py, arguments.py) ---
    Case("mlx", "clamp_input_cast_to_result",
         _seeded(lambda: (Fn(lambda x: torch.clamp(x * 2, min=0.5) * 3), (torch.arange(-3, 5, dtype=torch.int32).reshape(2, 4),))),
         "aten_clamp_default", "aten.clamp.default", default=True),
    Case("mlx", "nearest_scales_torch_ignores_dropped",
         _seeded(lambda: (Fn(lambda x: F.interpolate(x * 2, scale_factor=2.2, mode="nearest") + 1), (torch.randn(1, 1, 3, 3),))),
         "aten_upsample_nearest2d_vec", "aten.upsample_nearest2d.vec"),
    Case("mlx", "nearest_rows_unlike_torch",
         _seeded(lambda: (Fn(lambda x: F.interpolate(x * 2, scale_factor=49.0, mode="nearest") + 1), (torch.randn(1, 1, 2, 2),))),
         "aten_upsample_nearest2d_vec", "aten.upsample_nearest2d.vec"),
    Case("mlx", "ignored_arguments_made_explicit",
         _seeded(lambda: (Fn(lambda x: torch.sort(x * 2, descending=True)[0] + 1), (torch.randn(2, 6),))),
         "aten_sort_default", "aten.sort.default"),
    Case("mlx", "copy_source_like_destination",
         _seeded(lambda: (Fn(lambda y, x: (y + 1).copy_(x * 2) * 2), (torch.zeros(2, 4, dtype=torch.int32), torch.randn(2, 4)))),
         "aten_copy_default", "aten.copy.default"),
    Case("mlx", "integer_floor_division",
         _seeded(lambda: (Fn(lambda x: torch.div(x * 3, 2, rounding_mode="floor") * 2 + 1), (torch.arange(8).reshape(2, 4),))),
         "aten_div_tensor_mode", "aten.div.Tensor_mode"),
    Case("mlx", "same_rank_single_index",
         _seeded(lambda: (Fn(lambda x, i: (x * 2)[i].sum() + 1), (torch.randn(4, 4), torch.tensor([[0, 3, 1, 2]])))),
         "aten_index_tensor", "aten.index.Tensor"),
    Case("mlx", "unwritten_output_read",
         _seeded(lambda: (Fn(lambda x: F.max_pool2d(x * 2, 2, return_indices=True)[1] + 1), (torch.randn(1, 1, 4, 4),))),
         "aten_max_pool2d_with_indices_default", "aten.max_pool2d_with_indices.default", raises=True),
    Case("mlx", "rms_norm_epsilon_made_explicit",
         _seeded(lambda: (Fn(lambda x: F.rms_norm(x * 2, (4,), None, eps=None) + 1), (torch.randn(2, 4) * 1e-3,))),
         "aten_rms_norm_default", "aten.rms_norm.default"),
    Case("mlx", "fractional_correction",
         _seeded(lambda: (Fn(lambda x: torch.var(x * 2, correction=0.5) + 1), (torch.randn(2, 4),))),
         "aten_var_correction", "aten.var.correction"),
    Case("mlx", "repeat_interleave_flattened",
         _seeded(lambda: (Fn(lambda x: torch.repeat_interleave(x * 2, 2) + 1), (torch.randn(2, 3),))),
         "aten_repeat_interleave_self_int", "aten.repeat_interleave.self_int"),
    # --- XNNPACK rewrites and refusals (compiler/backends/xnnpack/rules.py) -------------------------
    Case("xnnpack", "bilinear_scale_unlike_size",
         _seeded(lambda: (Fn(lambda x: F.interpolate(x * 2, scale_factor=2.2, mode="bilinear") + 1), (torch.randn(1, 1, 3, 3),))),
         "aten_upsample_bilinear2d_vec", "aten.upsample_bilinear2d.vec", default=True),
    Case("xnnpack", "tanh_gelu_as_plain_ops",
         _seeded(lambda: (Fn(lambda x: F.gelu(x * 2, approximate="tanh") * 3), (torch.linspace(-4, 4, 64).reshape(4, 16),))),
         "aten_gelu_default", "aten.gelu.default"),
    Case("xnnpack", "addmm_scaled", _seeded(lambda: (ScaledAddmm(), (torch.randn(4, 5),))),
         "aten_addmm_default", "aten.addmm.default"),
    # XNNPACK fuses the weight's dequantize_affine (and its permute) into the GEMM: they have no value
    # of their own to cut out (its linear pattern of two outputs is refused), so locate names the GEMM
    # computing with them and says they are fused into it.
    Case("xnnpack", "dequantize_with_plain_ops", _seeded(_weight_only_linear),
         "aten_addmm_default", "aten.addmm.default"),
    # --- the portable runtime's wrong CPU kernels (compiler/ir/kernels.py WRONG_KERNELS) ------------
    Case("cpu_kernels", "integer_remainder",
         _seeded(lambda: (Fn(lambda a, b: torch.remainder(a * 2, b) + 1), (torch.arange(-4, 4).reshape(2, 4), torch.tensor([3])))),
         "aten_remainder_tensor", "aten.remainder.Tensor", stage="emit", default=True),
    Case("cpu_kernels", "half_precision_accumulation",
         _seeded(lambda: (Fn(lambda x: F.layer_norm(x * 2, (2048,)) + 1), (torch.randn(2, 2048, dtype=torch.float16),))),
         "aten_native_layer_norm_default", "aten.native_layer_norm.default", stage="emit"),
)


@attrs.frozen
class Outcome:
    """What one case gave: the check's result (or the error it raised), the location (or the
    error locate raised)."""

    case: Case
    check: Any = None
    check_error: BaseException | None = None
    location: Any = None
    locate_error: BaseException | None = None
    compile_seconds: float = 0.0

    @property
    def fault_seen(self) -> bool:
        return self.check_error is not None or (self.check is not None and not self.check.passed)

    @property
    def located(self) -> bool:
        d = getattr(self.location, "divergence", None)
        return (
            self.location is not None and self.location.stage == self.case.stage and d is not None
            and (d.node, d.op) == (self.case.node, self.case.op)
        )


_OUTCOMES: dict[str, Outcome] = {}


def outcome(case: Case) -> Outcome:
    """Compile `case` with its fix off, check it against eager, and locate the divergence (all
    inside the switch: the cut lowers the delegate again); once per process."""
    if case.id not in _OUTCOMES:
        _OUTCOMES[case.id] = _outcome(case)
    return _OUTCOMES[case.id]


def _outcome(case: Case) -> Outcome:
    import compiler
    from compiler.running.runtime import compare_with_eager

    model, inputs = case.build()
    with case.switches().off(case.switch):
        start = time.perf_counter()
        result = compiler.compile(model, inputs, case.backend, backend_options=case.options, verify=False,
                                  reproducer=False)
        compiled = time.perf_counter() - start
        check = check_error = location = locate_error = None
        try:
            check = compare_with_eager(result, model, inputs)
        except Exception as exc:  # the check refused to run the program: the fault seen, loudly
            check_error = exc
        try:
            location = compiler.locate_result(result, model, inputs)
        except Exception as exc:
            locate_error = exc
    return Outcome(case, check, check_error, location, locate_error, compiled)


def row(o: Outcome) -> dict:
    case, d = o.case, getattr(o.location, "divergence", None)
    if o.check_error is not None:
        check = f"refused: {type(o.check_error).__name__}"
    elif o.check is not None:
        check = f"{'passed' if o.check.passed else 'FAILED'}: error {o.check.max_abs_error:.3g}"
        if o.check.integer_error:
            check += f", integer {o.check.integer_error:.3g}"
    else:
        check = "-"
    return {
        "id": case.id, "owner": case.owner, "switch": case.switch, "backend": case.backend,
        "fault": case.what(), "check": check, "fault_seen": o.fault_seen,
        "expected_stage": case.stage, "expected_node": case.node, "expected_op": case.op,
        "stage": getattr(o.location, "stage", None),
        "node": d.node if d else None, "op": d.op if d else None,
        "found_by": d.found_by if d else None,
        "note": getattr(o.location, "note", None),
        "locate_error": None if o.locate_error is None else f"{type(o.locate_error).__name__}: {str(o.locate_error).splitlines()[0][:200]}",
        "located": o.located, "why_not_yet": case.xfail,
        "locate_seconds": round(o.location.seconds, 2) if o.location is not None else None,
        "compile_seconds": round(o.compile_seconds, 2),
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| fault (switch off) | backend | check with the fix off | stage located | node located (op) | "
        "the fix's node | locate s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["locate_error"]:
            node = f"raised {r['locate_error'].split(':')[0]}"
        elif r["node"]:
            node = f"`{r['node']}` ({r['op']})"
        else:
            node = "none named"
        mark = "yes" if r["located"] else "**not yet**"
        seconds = "-" if r["locate_seconds"] is None else f"{r['locate_seconds']:.1f}"
        lines.append(
            f"| `{r['id']}` | {r['backend']} | {r['check']} | {r['stage'] or '-'} | {node} | "
            f"`{r['expected_node']}`: {mark} | {seconds} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=[c.id for c in CASES], help="these cases only")
    parser.add_argument("--json", default=DEFAULT_JSON)
    parser.add_argument("--markdown", default=DEFAULT_MARKDOWN)
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.ERROR)
    rows = []
    for case in CASES:
        if args.only and case.id not in args.only:
            continue
        r = row(outcome(case))
        rows.append(r)
        print(f"{r['id']:58} {r['check'][:32]:32} {r['stage']!s:6} {r['node']!s:36} "
              f"{'located' if r['located'] else 'NOT YET'} ({r['locate_seconds']} s)", flush=True)
    text = table(rows)
    print()
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    with open(args.markdown, "w") as f:
        f.write("# Faults located: each fix switched off\n\n")
        f.write(f"`python -m benchmarks.locate_faults` (torch {torch.__version__}, {platform.machine()}). ")
        f.write(
            "Each row turns one fix off (`compiler.ir.fix_switches`), compiles a small model that needs it "
            "(verify-each off), checks it against eager, and runs `compiler.locate_result` on that compile. "
            "'locate s' is the time locate took (the compile not counted). 'not yet': the reason is in the "
            "JSON (`why_not_yet`) and at the case in `benchmarks/locate_faults.py`; its test in "
            "`tests/test_locate_faults.py` is a strict xfail.\n\n"
        )
        f.write(text + "\n")
        not_yet = [r for r in rows if not r["located"]]
        if not_yet:
            f.write("\nWhy not yet:\n\n")
            for r in not_yet:
                f.write(f"- `{r['id']}`: {r['why_not_yet'] or r['note'] or r['locate_error']}\n")
    with open(args.json, "w") as f:
        json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
