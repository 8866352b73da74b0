"""Proof that `locate` finds real faults (issue 31, item 4): for each fix switch
(`compiler.ir.fix_switches`: Core ML conversion fixes, MLX and XNNPACK rewrites and refusals, the
portable runtime's wrong CPU kernels), a small model that needs the fix (`benchmarks.locate_faults.CASES`).

With the fix off, the check against eager fails (or refuses to run the payload), and with it on
passes: the fault is real and the fix's. And `locate`, run on the fix-off compile, names the
stage and the node the fix exists for (its name and op). Where it cannot yet, the case says why
and its test is a strict xfail, so it flips when `locate` can.

One case per backend runs by default; the rest with -m slow. `python -m benchmarks.locate_faults`
runs them all into a table.
"""

from __future__ import annotations

import importlib

import pytest

import compiler
from benchmarks import locate_faults
from benchmarks.locate_faults import CASES, OWNERS, outcome
from compiler.ir import fix_switches
from compiler.running.runtime import compare_with_eager


def _params(located: bool):
    params = []
    for case in CASES:
        marks = [] if case.default else [pytest.mark.slow]
        if located and case.xfail:
            marks.append(pytest.mark.xfail(reason=case.xfail, strict=True))
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


@pytest.mark.parametrize("case", _params(located=False))
def test_the_fault_is_real(case):
    """Off, the check fails (or refuses the payload); on, it passes."""
    found = outcome(case)
    if case.raises:
        assert found.check_error is not None, found.check
    else:
        assert found.check_error is None, found.check_error
        assert not found.check.passed, found.check.describe()
    model, inputs = case.build()
    fixed = compiler.compile(model, inputs, case.backend, backend_options=case.options, reproducer=False)
    check = compare_with_eager(fixed, model, inputs)
    assert check.passed, check.describe()


@pytest.mark.parametrize("case", _params(located=True))
def test_locate_names_the_node_the_fix_is_for(case):
    found = outcome(case)
    if found.locate_error is not None:
        raise found.locate_error
    location = found.location
    assert location.stage == case.stage, location.describe()
    d = location.divergence
    assert d is not None, location.describe()
    assert (d.node, d.op) == (case.node, case.op), location.describe()
    if case.stage == "lower" and case.backend != "portable":
        assert d.delegate is not None  # found inside the payload, not at the delegate call


# --- every switch has its case; the switching itself ---------------------------------------


@pytest.mark.slow
def test_a_node_the_backend_fuses_is_named_with_the_op_it_is_fused_into():
    """XNNPACK fuses a weight-only linear's dequantize into its GEMM, whose partition it cannot
    lower with the dequantize as an extra output: locate names the GEMM and the fused nodes."""
    (case,) = [c for c in CASES if c.switch == "dequantize_with_plain_ops"]
    divergence = outcome(case).location.divergence
    assert divergence.node == "aten_addmm_default"
    assert "torchao_dequantize_affine_default could not leave the delegate" in divergence.found_by


@pytest.mark.parametrize("owner", list(OWNERS))
def test_every_switch_has_a_fault_case(owner):
    fixes = importlib.import_module(OWNERS[owner][0]).FIXES
    covered = {case.switch for case in CASES if case.owner == owner}
    # index_put_refusals: switched off, the check finds no wrong number (see test_fix_switches.py).
    skipped = {"index_put_refusals"} if owner == "coreml" else set()
    assert covered == set(fixes) - skipped


def test_one_switch_mechanism_for_every_owner():
    from compiler.backends.coreml import fixes as coreml_fixes

    for owner, (module, _) in OWNERS.items():
        importlib.import_module(module)
    assert set(OWNERS) <= set(fix_switches.registered())
    assert fix_switches.switches("coreml") is coreml_fixes.SWITCHES
    mlx = fix_switches.switches("mlx")
    with coreml_fixes.fixes_off("tanh_gelu"), fix_switches.fixes_off("mlx", "clamp_input_cast_to_result"):
        with mlx.off("clamp_input_cast_to_result"):
            assert not mlx.on("clamp_input_cast_to_result") and not coreml_fixes.on("tanh_gelu")
        assert not mlx.on("clamp_input_cast_to_result")  # the outer block still holds it off
        assert fix_switches.switches("xnnpack").on("tanh_gelu_as_plain_ops")  # another owner's: on
    assert mlx.on("clamp_input_cast_to_result") and coreml_fixes.on("tanh_gelu")
    with pytest.raises(ValueError, match="unknown mlx fix 'tanh_gelu'"):
        with mlx.off("tanh_gelu"):
            pass
    with pytest.raises(ValueError, match="registered with other fixes"):
        fix_switches.register("mlx", {"other": "fix"})


def test_the_table_script_writes_its_rows(tmp_path, monkeypatch):
    """One command for the table; here one case (its outcome already made by the tests above or now)."""
    (case,) = [c for c in CASES if c.id == "mlx.clamp_input_cast_to_result"]
    rows = locate_faults.main(["--only", case.id, "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md")])
    assert [r["id"] for r in rows] == [case.id] and rows[0]["located"] and rows[0]["fault_seen"]
    assert f"| `{case.id}` | mlx |" in (tmp_path / "r.md").read_text()
