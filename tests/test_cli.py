"""The CLI: a thin layer over the API; errors exit non-zero with a message, no traceback."""

import subprocess
import sys

import pytest

from compiler.cli.main import main
from compiler.models.examples import MODELS


def test_examples_lists_every_builtin_and_the_model_suite(capsys):
    assert main(["examples"]) == 0
    out = capsys.readouterr().out
    for name in MODELS:
        assert name in out
    assert "gpt2" in out and "needs pip install -e '.[models]'" in out


def test_compile_check_prints_stage_table_and_error(capsys, tmp_path):
    out_file = tmp_path / "mlp.pte"
    assert main(["compile", "mlp", "--backend", "xnnpack", "--check", "-o", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["stage", "time", "s"]
    for stage in ("capture", "fold", "decompose", "partition", "split_constants", "lower", "emit", "total"):
        assert f"\n{stage} " in out
    assert "max abs error" in out and "OK" in out
    assert out_file.stat().st_size > 0


def test_model_from_file_factory(capsys, tmp_path):
    source = tmp_path / "my_model.py"
    source.write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).eval(), (torch.randn(2, 4),)\n"
    )
    assert main(["compile", f"{source}:make", "--backend", "portable", "--check"]) == 0
    assert "OK" in capsys.readouterr().out


def test_example_arguments(capsys):
    assert main(["compile", "transformer:depth=1,dim=32", "--stop-after", "capture"]) == 0
    assert "stopped after capture" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compile", "nosuchmodel"], "neither a built-in example"),
        (["compile", "missing.py:make"], "does not exist"),
        (["compile", "--resume-from", "nope.stage"], "does not exist"),
        (["compile"], "needs a MODEL"),
        (["compile", "mlp", "--fold-skip-ops", "aten.nope.default"], "names no operator"),
    ],
)
def test_bad_input_exits_nonzero_without_traceback(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compile", "mlp", "--backend", "tpu"], "invalid choice: 'tpu'"),
        (["compile", "mlp", "--dry-run-mode", "sometimes"], "invalid choice: 'sometimes'"),
        (["compile", "mlp", "--stop-after", "optimize"], "invalid choice: 'optimize'"),
    ],
)
def test_option_values_are_checked_by_the_flag_parser(capsys, argv, message):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and message in capsys.readouterr().err


def test_stop_after_and_resume_from_the_command_line(capsys, tmp_path):
    stage_file = tmp_path / "p.stage"
    assert main(["compile", "mlp", "--backend", "xnnpack", "--stop-after", "partition", "-o", str(stage_file)]) == 0
    assert main(["compile", "mlp", "--backend", "xnnpack", "--resume-from", str(stage_file), "--check"]) == 0
    out = capsys.readouterr().out
    assert "lower" in out and "OK" in out


def _check_raising(monkeypatch, exception: BaseException) -> None:
    """The compile's check raises `exception`, as a bug in it would (issue 54's dtype crash did)."""
    from compiler.running import runtime

    def check(*args, **kwargs):
        raise exception

    monkeypatch.setattr(runtime, "compare_with_eager", check)


def test_a_crash_exits_2_with_one_line_naming_where_it_crashed(capsys, monkeypatch):
    # It left main() with its 118-line traceback, and Python's exit 1: the code of a failed check.
    _check_raising(monkeypatch, RuntimeError("expected m1 and m2 to have the same dtype\n(its second line)"))
    assert main(["compile", "mlp", "--check", "--no-cache", "-q"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: crashed while checking against eager: RuntimeError: expected m1 and m2 to have the same dtype "
        "(--traceback shows where)"
    ]
    assert main(["compile", "mlp", "--check", "--no-cache", "-q", "--traceback"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Traceback (most recent call last):" and err[-1].startswith("error: crashed while checking")


def _interrupted(argv: list[str]) -> int:
    """main()'s exit code when Ctrl-C stops it (a KeyboardInterrupt leaving it fails the test, not the session)."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left main() as a KeyboardInterrupt, with its traceback")


def test_ctrl_c_says_so_in_one_line_and_exits_130(capsys, monkeypatch):
    _check_raising(monkeypatch, KeyboardInterrupt())
    assert _interrupted(["compile", "mlp", "--check", "--no-cache", "-q"]) == 130
    assert capsys.readouterr().err.splitlines() == ["interrupted while checking against eager"]


def test_ctrl_c_in_a_stage_names_the_stage(capsys, monkeypatch):
    from compiler.stages.fold import Fold

    def interrupted(self, program, ctx):
        raise KeyboardInterrupt

    monkeypatch.setattr(Fold, "apply", interrupted)
    assert _interrupted(["compile", "mlp", "--no-cache"]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "interrupted while running stage fold"


def test_console_entry_point_runs_as_module():
    done = subprocess.run(
        [sys.executable, "-m", "compiler", "compile", "nosuchmodel"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "error:" in done.stderr and "Traceback" not in done.stderr


def test_check_on_a_program_this_machine_cannot_run_says_so(capsys, monkeypatch):
    import attrs

    from compiler.ir import targets

    # A delegate with neither a runtime kernel here nor a reference runner (Core ML's taken away).
    without_runner = attrs.evolve(targets.BY_DELEGATE_ID["CoreMLBackend"], reference_runner=None)
    monkeypatch.setitem(targets.BY_DELEGATE_ID, "CoreMLBackend", without_runner)
    assert main(["compile", "mlp", "--backend", "coreml", "--check"]) == 2
    err = capsys.readouterr().err
    assert "CoreMLBackend" in err and "can run neither" in err and "Traceback" not in err


def test_suggested_options_are_flags_on_the_command_line_and_keywords_in_the_api():
    from compiler.cli.main import render_error
    from compiler.ir.errors import CompileError

    error = CompileError(
        "no",
        hint="try",
        suggest={"backend": "mlx", "fold_skip_ops": ["aten.t.default"], "verify": False, "take_over_mutable_buffer": False},
    )
    assert "what to do: try (--backend mlx --fold-skip-ops aten.t.default --no-verify "
    "--backend-option take_over_mutable_buffer=false)" in render_error(error)
    assert "what to do: try (backend='mlx', fold_skip_ops=['aten.t.default'], verify=False, "
    "take_over_mutable_buffer=False)" in str(error)
