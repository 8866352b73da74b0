"""What a user sees: one line for a mistyped choice, at once; a scheme the backend does not take
refused before any work; help that says what a flag does; errors that name flags; locate at the
check's tolerance."""

import re
import subprocess
import sys
import time

import pytest

from compiler.cli.main import main


def _cli(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "compiler", *argv], capture_output=True, text=True, timeout=120)
    return done, time.perf_counter() - start


@pytest.mark.parametrize(
    "argv, says",
    [
        (["compile", "mlp", "--backend", "nope"], "argument --backend: invalid choice: 'nope' (choose from 'portable'"),
        (["compile", "mlp", "--quantize", "nope"], "argument --quantize: invalid choice: 'nope' (choose from 'int8_dynamic'"),
        (["generate", "llama", "--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
        (["compile", "mlp", "--backend", "mlx", "--quantize", "int8_dynamic"],
         "the mlx backend does not take the quantize scheme 'int8_dynamic'"),
    ],
)
def test_a_bad_choice_is_refused_at_once_in_one_line_with_the_choices(argv, says):
    done, seconds = _cli(*argv)
    assert done.returncode == 2 and done.stdout == ""
    first, *rest = done.stderr.strip().splitlines()
    assert says in first, done.stderr
    assert len(rest) <= 1, done.stderr  # the advice, and nothing of argparse's usage
    assert "usage:" not in done.stderr
    assert seconds < 5, seconds  # no torch loads (about 0.2 s on a quiet machine)


def test_a_scheme_refused_loads_no_torch():
    script = ("import sys; from compiler.cli.main import main; code = main(['compile', 'mlp', '--backend', 'mlx', "
              "'--quantize', '8da4w']); print('torch' in sys.modules); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout.strip() == "False", done.stdout + done.stderr


@pytest.mark.parametrize(
    "flag, says",
    [
        ("--no-verify", "skip checking each stage's output"),
        ("--no-cache", "compile every stage, neither loading from the stage cache nor storing in it"),
        ("--no-reproducer", "save nothing when a stage fails"),
        ("--no-emit-extract-delegate-segments", "store delegate payloads inside the program"),
    ],
)
def test_a_no_flags_help_says_what_it_does(flag, says, capsys):
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"{flag} {says}" in out
    assert "this flag turns it off" not in out


def test_an_api_keyword_in_an_error_is_shown_as_its_flag(capsys):
    assert main(["compile", "mlp", "--backend", "xnnpack", "--quantize", "8da4w", "--quantize-granularity",
                 "per_tensor"]) == 2
    err = capsys.readouterr().err
    assert "give --quantize-granularity per_group" in err and "quantize_granularity" not in err


def test_a_factory_called_with_a_keyword_it_lacks_names_those_it_takes(capsys):
    assert main(["compile", "mlp:nope=3"]) == 2
    err = capsys.readouterr().err
    assert "what to do: it takes features, hidden, layers, batch" in err
    assert "--traceback" not in err and "check the factory" not in err


def test_locate_uses_the_tolerance_the_check_was_given(capsys):
    """`--check --locate --tolerance T`: the check fails at T, and locate holds the stages to T too
    (it used each stage's own 1e-4 and said that every stage agrees)."""
    assert main(["compile", "mlp", "--backend", "xnnpack", "--no-cache", "--check", "--locate",
                 "--tolerance", "1e-12"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH (tolerance 1e-12, absolute, as given)" in out
    assert "every stage's outputs agree with eager" not in out
    assert re.search(r"^lower\s.*\s1e-12\s+DIVERGES$", out, re.M), out  # the location's stage table


NOISE = ("Failed to load", "_pytree.py", "Registering", "WARNING", "Warning", "warn(", "coremltools")


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "llama", "--tokens", "4", "--max-cache-len", "16", "--check"],
        ["compile", "mlp", "--backend", "xnnpack", "--check", "--no-cache"],
        ["locate", "mlp", "--backend", "coreml"],
    ],
    ids=["generate", "compile", "locate"],
)
def test_a_run_prints_only_what_our_code_wrote(argv):
    """What dependencies print while they load and run (torchao's missing CUDA libraries, torch's
    pytree deprecation, tokenizers, coremltools) is kept for -v, not printed."""
    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, "-m", "compiler", *argv], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "NO_COLOR": "1"})
    assert done.returncode in (0, 1), done.stderr
    printed = [line for line in (done.stdout + done.stderr).splitlines() if any(n in line for n in NOISE)]
    assert not printed, "\n".join(printed)
