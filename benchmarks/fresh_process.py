"""Runs `python -m compiler ...` as fresh processes, cold then warm, as a user re-running a
command does: python's start, every import and the command's own work are in the wall time.

The processes run a snapshot of the compiler package taken first: cache keys hold a digest
of the compiler's sources, so someone editing the checkout between the cold and the warm
run (a shared machine) would turn the warm run into a miss.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Callable

import compiler

PACKAGE = os.path.dirname(os.path.abspath(compiler.__file__))


def snapshot(folder: str) -> str:
    """A copy of the compiler package under `folder`; the folder to run the processes in."""
    source = os.path.join(folder, "snapshot")
    shutil.copytree(PACKAGE, os.path.join(source, "compiler"), ignore=shutil.ignore_patterns("__pycache__"))
    return source


def run(arguments: list[str], source: str) -> dict:
    """`python -m compiler *arguments` from `source` (its compiler package first on the path):
    its wall time, the load average before it, and what it printed."""
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "compiler", *arguments], cwd=source, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": source})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"`python -m compiler {' '.join(arguments)}` failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return {"wall_seconds": wall, "load_average_before": load, "stdout": done.stdout, "stderr": done.stderr}


def startup(source: str) -> float:
    """A fresh process's fixed cost before any command: python and the CLI's imports."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import compiler.cli.main"], cwd=source, check=True,
                   env={**os.environ, "PYTHONPATH": source})
    return time.perf_counter() - start


def cold_then_warm(arguments: list[str], source: str, full_hit: Callable[[dict], bool]) -> dict:
    """The command twice (its cache folder empty first): both wall times, the warm run's share
    of the cold one's, and whether `full_hit(warm run)` says the warm run compiled nothing."""
    cold = run(arguments, source)
    warm = run(arguments, source)
    hit = full_hit(warm)
    for done in (cold, warm):
        del done["stdout"], done["stderr"]
    command = "python -m compiler " + " ".join(arguments).replace(os.path.dirname(source), "$TMP")
    return {"command": command, "cold": cold, "warm": warm,
            "warm_over_cold": warm["wall_seconds"] / cold["wall_seconds"], "warm_full_hit": hit,
            "startup_seconds": startup(source)}
