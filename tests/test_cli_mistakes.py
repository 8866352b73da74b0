"""Every user mistake is a named error before any work: exit code 2, no traceback, the
path or value named and what to do. Fast start: `--help`, `examples` and argument
errors answer before torch is imported (checked through sys.modules)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from compiler.cli.main import main

HEAVY = ("torch", "executorch", "coremltools", "mlx")


# argv -> (exit code, what it must print), each answered before torch is imported.
ANSWERED_EARLY = [
    (["--help"], 0, "compile"),
    (["compile", "--help"], 0, "default: portable"),
    (["examples"], 0, "transformer"),
    (["compile", "mlp", "--backend", "tpu"], 2, "invalid choice: 'tpu'"),
    (["compile", "mlp", "--stop-after", "optimize"], 2, "invalid choice: 'optimize'"),
    (["compile", "nosuchmodel"], 2, "neither a built-in example"),
    (["compile", "mlp", "--backend-option", "no_equals_sign"], 2, "is not KEY=VALUE"),
    (["compile", "mlp", "-o", "/proc/version/x.pte"], 2, "cannot create the folder"),
    # /proc exists and passes a permission check, even as root, but no file can be made in it.
    (["compile", "mlp", "-o", "/proc/x.pte"], 2, "-o '/proc/x.pte': no file can be written in the folder '/proc'"),
    (["compile", "mlp", "--report-json", "/proc/r.json"], 2, "--report-json '/proc/r.json': no file can be written"),
    (["compile", "mlp", "-o", "/tmp/" + "x" * 300 + ".pte"], 2, "the file cannot be written (File name too long)"),
    (["compile", "mlp", "--dump-dir", "/proc"], 2, "--dump-dir '/proc': no file can be written in the folder"),
]


@pytest.fixture(scope="module")
def answers() -> list[tuple[int, list[str], str]]:
    """Runs the CLI on each argv of ANSWERED_EARLY, one after another, in one fresh interpreter
    (a process start each took seconds); returns per argv its exit code, the heavy packages
    imported so far (none may be: then none of the answers before it imported one either) and
    what it printed."""
    probe = textwrap.dedent(
        f"""
        import contextlib, io, json, sys
        from compiler.cli.main import main
        answers = []
        for argv in {[argv for argv, _, _ in ANSWERED_EARLY]!r}:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                try:
                    code = main(argv)
                except SystemExit as exit:
                    code = exit.code
            heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))
            answers.append([code, heavy, printed.getvalue()])
        print(json.dumps(answers), file=sys.__stdout__)
        """
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(answers) == len(ANSWERED_EARLY)
    return [(code, heavy, printed + done.stderr) for code, heavy, printed in answers]


@pytest.mark.parametrize("case", range(len(ANSWERED_EARLY)), ids=[" ".join(a)[:60] for a, _, _ in ANSWERED_EARLY])
def test_answers_before_torch_is_imported(answers, case):
    argv, code, said = ANSWERED_EARLY[case]
    exit_code, heavy, printed = answers[case]
    assert exit_code == code and said in printed
    assert heavy == [], f"{argv} imported {heavy}"


@pytest.fixture
def a_file(tmp_path):
    """A regular file: nothing can be created under it, whoever runs the test (root included)."""
    path = tmp_path / "not-a-folder"
    path.write_text("x")
    return path


@pytest.mark.parametrize("flag", ["-o", "--report-json", "--report-html"])
def test_a_file_under_a_file_is_refused_before_the_compile(capsys, a_file, flag):
    target = a_file / "out.file"
    assert main(["compile", "mlp", flag, str(target)]) == 2
    err = capsys.readouterr().err
    assert f"{flag} '{target}'" in err and "cannot create the folder" in err
    assert "what to do: give" in err and "Traceback" not in err
    assert "[1/10] quantize" not in err  # no stage ran


def test_a_dump_dir_under_a_file_is_refused_before_the_compile(capsys, a_file):
    assert main(["compile", "mlp", "--dump-dir", str(a_file / "dump")]) == 2
    err = capsys.readouterr().err
    assert "--dump-dir" in err and str(a_file / "dump") in err and "cannot create the folder" in err
    assert "[1/10] quantize" not in err and "Traceback" not in err


def test_checking_an_output_leaves_no_file_behind(capsys, tmp_path, monkeypatch):
    """The check creates the file to prove it can; a run that then fails writes nothing."""
    program = tmp_path / "mlp.pte"
    monkeypatch.setattr("compiler.api.compile", _fails)
    assert main(["compile", "mlp", "-o", str(program)]) == 2
    assert not program.exists()


def _fails(*args, **kwargs):
    from compiler.ir.errors import CompileError

    raise CompileError("a stage failed", stage="capture")


def test_a_write_that_fails_after_the_compile_is_named_and_the_rerun_is_cached(capsys, tmp_path, monkeypatch):
    """The disk fills (or the mount turns read-only) during the compile: a named error, and the
    stage cache holds the work, so the same command again loads every stage."""
    program, cache = tmp_path / "mlp.pte", tmp_path / "cache"
    argv = ["compile", "mlp", "-o", str(program), "--cache-dir", str(cache)]

    def disk_full(self, path):
        raise OSError(28, "No space left on device", str(path))

    with monkeypatch.context() as patched:
        patched.setattr("compiler.api.CompileResult.save", disk_full)
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"-o '{program}': writing the program failed after the compile (No space left on device)" in err
    assert "the stage cache" in err and str(cache) in err and "run the same command again" in err
    assert "Traceback" not in err
    assert main(argv) == 0
    out = capsys.readouterr()
    assert program.stat().st_size > 0
    assert "cached" in out.out + out.err


def test_an_output_that_is_a_folder_is_refused(capsys, tmp_path):
    assert main(["compile", "mlp", "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"-o '{tmp_path}' is a folder" in err and "give -o a file name" in err


def test_missing_parent_folders_are_created(capsys, tmp_path):
    program = tmp_path / "a" / "b" / "mlp.pte"
    report = tmp_path / "c" / "report.json"
    assert main(["compile", "mlp", "-o", str(program), "--report-json", str(report)]) == 0
    assert program.stat().st_size > 0 and json.loads(report.read_text())["stages"]


def test_without_output_the_cli_says_nothing_was_written(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["compile", "mlp"]) == 0
    assert "nothing written: give -o FILE.pte" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []


def test_a_missing_resume_file_is_named(capsys):
    assert main(["compile", "--resume-from", "nope.stage"]) == 2
    err = capsys.readouterr().err
    assert "--resume-from 'nope.stage'" in err and "does not exist" in err


def test_inputs_the_model_cannot_take_get_advice_about_inputs(capsys, tmp_path):
    source = tmp_path / "wrong_inputs.py"
    source.write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Linear(4, 4), (torch.randn(2, 5),)\n"
    )
    assert main(["compile", f"{source}:make"]) == 2
    err = capsys.readouterr().err
    assert "fails in eager PyTorch on the example inputs (Tensor[2, 5] float32)" in err
    assert "give example inputs of the shapes, dtypes and number forward() expects" in err
    assert "control flow" not in err and "Traceback" not in err


def test_untraceable_code_still_gets_advice_about_tracing(capsys, tmp_path):
    source = tmp_path / "branchy.py"
    source.write_text(
        "import torch\n"
        "class Branchy(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x + 1 if x.sum() > 0 else x - 1\n"
        "def make():\n"
        "    return Branchy(), (torch.randn(3),)\n"
    )
    assert main(["compile", f"{source}:make"]) == 2
    err = capsys.readouterr().err
    assert "torch.export could not capture Branchy" in err and "control flow" in err


def test_run_names_a_missing_program(capsys):
    assert main(["run", "missing.pte", "mlp"]) == 2
    assert "PROGRAM 'missing.pte' does not exist" in capsys.readouterr().err


def test_visualize_names_a_missing_or_foreign_file(capsys, tmp_path):
    assert main(["visualize", str(tmp_path / "nope.pte")]) == 2
    assert "does not exist" in capsys.readouterr().err
    notes = tmp_path / "notes.txt"
    notes.write_text("not a program")
    assert main(["visualize", str(notes), "--no-browser"]) == 2
    err = capsys.readouterr().err
    assert "notes.txt" in err and "what to do:" in err and "Traceback" not in err


def test_a_stage_option_naming_no_operator_is_refused_before_capture(capsys):
    assert main(["compile", "mlp", "--fold-skip-ops", "aten.nope.default"]) == 2
    err = capsys.readouterr().err
    assert "--fold-skip-ops names no operator: 'aten.nope.default'" in err and "what to do:" in err
    assert "[1/10] quantize" not in err and "saved to" not in err  # no stage ran, nothing to save
