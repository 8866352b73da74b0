"""What a compile shows on the terminal: one progress line per stage, our log with -v,
nothing with -q, and none of the dependencies' own output (it goes into the report)."""

import io
import re
import subprocess
import sys
import time

import pytest
import torch
from rich.console import Console

import compiler
from compiler.cli.live_progress import LiveProgress

PROGRESS_LINE = re.compile(r"^\[\d+/10\] \w+ +\d+\.\d\d s")


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "compiler", *argv], capture_output=True, text=True, timeout=600
    )


def test_a_compile_prints_progress_and_the_report_and_nothing_of_its_dependencies():
    # xnnpack with --check: ExecuTorch, torchao and coremltools load, cpuinfo talks from C.
    done = _cli("compile", "mlp", "--backend", "xnnpack", "--check")
    assert done.returncode == 0, done.stderr
    stderr = done.stderr.splitlines()
    assert [line.split()[1] for line in stderr] == list(compiler.STAGE_NAMES)
    assert all(PROGRESS_LINE.match(line) for line in stderr), stderr
    for noise in ("WARNING", "cpuinfo", "torchao", "Warning", "coremltools"):
        assert noise not in done.stdout + done.stderr
    assert "check:" in done.stdout and "OK" in done.stdout


@pytest.mark.slow
def test_verbose_shows_our_log_and_what_dependencies_printed():
    done = _cli("compile", "mlp", "--backend", "xnnpack", "--check", "-v")
    assert done.returncode == 0, done.stderr
    assert "INFO compiler.driver.pipeline: capture:" in done.stderr
    assert "what dependencies printed" in done.stderr
    assert "cpuinfo" in done.stderr  # from C, on file descriptor 2, while the check loaded the program


@pytest.mark.slow  # a fresh process (10 s); the default run keeps the progress lines' and the API's
def test_quiet_prints_nothing_on_success():
    done = _cli("compile", "mlp", "-q")
    assert done.returncode == 0 and done.stdout == "" and done.stderr == ""


def test_the_api_keeps_dependency_output_in_the_report(capfd):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    artifact = compiler.compile(model, (torch.randn(2, 4),), "coreml")
    printed = capfd.readouterr()
    assert printed.out == "" and printed.err == ""
    # ExecuTorch's Core ML preprocess warns about the deployment target, as a log record.
    lower = artifact.report.stage("lower").messages
    assert any("specification version" in line for line in lower), lower


def test_the_api_can_leave_dependency_output_alone(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    artifact = compiler.compile(model, (torch.randn(2, 4),), "coreml", capture_dependency_output=False)
    assert all(not r.messages for r in artifact.report.stages)
    assert any("specification version" in r.getMessage() for r in caplog.records)  # reached the caller's logging


def test_coremltools_progress_is_folded_into_the_lower_stage_line():
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    steps = []
    progress = LiveProgress(console, live=True)
    original = progress._step

    def step(desc, done, total):
        steps.append((desc, done, total))
        original(desc, done, total)
        if desc.startswith("Running MIL") and done == 1:
            # The display redraws on a timer (10 a second): a warm, tiny conversion can end
            # before it does. Held here, the step is drawn at least once.
            time.sleep(0.5)

    progress._step = step
    compiler.compile(model, (torch.randn(2, 4),), "coreml", instruments=[progress])
    finished = {desc for desc, done, total in steps if done == total}
    assert "Running MIL default pipeline" in finished, steps
    assert any(desc == "Converting PyTorch Frontend ==> MIL Ops" and done > 0 for desc, done, _ in steps), steps
    assert "[9/10] lower" in screen.getvalue() and "Running MIL" in screen.getvalue()


def test_plain_progress_has_one_line_per_stage():
    screen = io.StringIO()
    model = torch.nn.Linear(4, 4)
    compiler.compile(model, (torch.randn(2, 4),), instruments=[LiveProgress(Console(file=screen), live=False)])
    lines = screen.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == list(compiler.STAGE_NAMES)
    assert all(PROGRESS_LINE.match(line) for line in lines)


def test_captures_in_threads_share_one_redirection_and_give_the_descriptors_back(capfd):
    import os
    import threading

    failures = []

    def compile_one():
        try:
            compiler.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()), (torch.randn(2, 4),), "coreml")
        except BaseException as exc:  # reported below, not lost in the thread
            failures.append(exc)

    threads = [threading.Thread(target=compile_one) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    os.write(1, b"fd 1 is back\n")
    os.write(2, b"fd 2 is back\n")
    print("sys.stdout is back")
    printed = capfd.readouterr()
    assert printed.out == "fd 1 is back\nsys.stdout is back\n" and printed.err == "fd 2 is back\n"


@pytest.mark.slow  # 7-8 s: over the default run's budget; runs with -m slow
def test_compiling_and_running_through_the_api_print_nothing():
    # A fresh process: ExecuTorch's runtime talks (cpuinfo, from C) only the first time it loads.
    script = (
        "import torch, compiler\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())\n"
        "artifact = compiler.compile(model, (torch.randn(2, 4),), 'xnnpack')\n"
        "loaded = compiler.LoadedProgram(artifact)\n"
        "loaded((torch.randn(2, 4),))\n"
        "assert any('cpuinfo' in line for line in loaded.messages), loaded.messages\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""
