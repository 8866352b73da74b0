"""The layers import downward only: import-linter's contracts (pyproject.toml) hold."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def _lint_with(tmp_path, module: str, statement: str) -> subprocess.CompletedProcess:
    """The contracts run over a copy of the package in which `module` gains a function holding `statement`."""
    shutil.copytree(ROOT / "compiler", tmp_path / "compiler", ignore=shutil.ignore_patterns("__pycache__", "assets"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    source = tmp_path / module
    source.write_text(source.read_text() + f"\n\ndef _added():\n    {statement}  # noqa: F401\n")
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    return subprocess.run([lint, "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(tmp_path), "PATH": str(Path(sys.executable).parent)})


def test_an_upward_import_breaks_a_contract(tmp_path):
    """The contracts see an import from ir up into the driver (a copy of the package gets one)."""
    done = _lint_with(tmp_path, "compiler/ir/graph.py", "from compiler.driver import config")
    assert done.returncode != 0
    assert "compiler.ir.graph -> compiler.driver.config" in done.stdout


def test_every_stage_is_in_the_independence_contract():
    import tomllib

    from compiler.stages import STAGES

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    [independent] = [c for c in contracts if c["type"] == "independence"]
    assert independent["modules"] == [row.module for row in STAGES]


def test_a_stage_importing_another_stage_breaks_a_contract(tmp_path):
    done = _lint_with(tmp_path, "compiler/stages/dry_run.py", "from compiler.stages import fold")
    assert done.returncode != 0
    assert "compiler.stages.dry_run -> compiler.stages.fold" in done.stdout
