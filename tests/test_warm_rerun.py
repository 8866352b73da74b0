"""The program cache: a warm re-run of a compile or a sweep, from a fresh process, takes the
.pte from the cache without capture, torch or ExecuTorch; anything that could change the
program changes the key (an option, a backend option, the model file's source), and a bad
entry falls back to compiling."""

import json
import os
import subprocess
import sys

import pytest

from compiler.cli.main import main
from compiler.driver import cache as stage_cache, program_cache
from compiler.driver.cache import ENTRY_SUFFIX
from compiler.driver.config import STAGE_NAMES, CompileConfig, split_options
from compiler.driver.program_cache import ProgramCache, program_key
from compiler.tools import sweeps

MODEL = "mlp:features=8,hidden=16,layers=2"
MODEL_FILE = """import torch


def make():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4) * {scale},)
"""


def _config(backend: str, backend_options=None, **options) -> CompileConfig:
    return CompileConfig(backend=backend, backend_options=backend_options or {}).with_options(options)


def _for_run(options) -> ProgramCache | None:
    config_options, driving = split_options(options)
    return ProgramCache.for_run(MODEL, _config("portable", **config_options), driving)


def _compile(tmp_path, model, name, *flags):
    """The CLI's compile in this process; the cached stages of its report."""
    report = tmp_path / f"{name}.json"
    assert main(["compile", model, "--backend", "portable", "--cache-dir", str(tmp_path / "cache"),
                 "-o", str(tmp_path / f"{name}.pte"), "--report-json", str(report), "-q", *flags]) == 0
    return [s["stage"] for s in json.loads(report.read_text())["stages"] if s["cached"]]


def test_a_fresh_process_rerun_takes_the_program_without_capture_or_torch(tmp_path):
    # The source digest as the checkout is now, as the fresh process will take it (one taken
    # by an earlier test would miss after an edit of the checkout in between).
    stage_cache._source_digest.cache_clear()
    assert _compile(tmp_path, MODEL, "cold") == []
    # The warm run in a fresh process: it must not import torch (so nothing was captured or built).
    arguments = ["compile", MODEL, "--backend", "portable", "--cache-dir", str(tmp_path / "cache"),
                 "-o", str(tmp_path / "warm.pte"), "--report-json", str(tmp_path / "warm.json"), "-v"]
    script = (f"import sys; from compiler.cli.main import main; code = main({arguments!r}); "
              "sys.exit(code or ('torch' in sys.modules and 'torch was imported') or ('executorch' in sys.modules "
              "and 'executorch was imported'))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "program cache: loaded the program" in done.stderr
    assert (tmp_path / "warm.pte").read_bytes() == (tmp_path / "cold.pte").read_bytes()
    report = json.loads((tmp_path / "warm.json").read_text())
    assert [s["stage"] for s in report["stages"]] == list(STAGE_NAMES)
    assert all(s["cached"] for s in report["stages"])
    assert report["shares"] == json.loads((tmp_path / "cold.json").read_text())["shares"]


def test_a_changed_option_or_backend_option_changes_the_key():
    key = program_key(MODEL, _config("xnnpack"))
    assert key == program_key(MODEL, _config("xnnpack"))
    assert key != program_key(MODEL, _config("xnnpack", emit_extract_delegate_segments=False))
    assert key != program_key(MODEL, _config("xnnpack", {"per_op_mode": True}))
    assert key != program_key(MODEL, _config("portable"))
    assert key != program_key("mlp:features=8,hidden=16,layers=3", _config("xnnpack"))
    assert key != program_key(MODEL, _config("xnnpack"), calibration=2)


def test_the_compilers_version_and_dependencies_are_in_the_key(monkeypatch):
    key = program_key(MODEL, _config("portable"))
    monkeypatch.setattr(program_cache.stage_cache, "project_version", lambda: "0+edited")
    assert program_key(MODEL, _config("portable")) != key
    monkeypatch.undo()
    monkeypatch.setattr(program_cache, "dependency_versions", lambda: {"torch": "0.0"})
    assert program_key(MODEL, _config("portable")) != key


def test_a_changed_model_file_or_option_misses(tmp_path):
    (tmp_path / "model").mkdir()
    source = tmp_path / "model" / "net.py"
    source.write_text(MODEL_FILE.format(scale=1.0))
    model = f"{source}:make"
    assert _compile(tmp_path, model, "first") == []
    assert _compile(tmp_path, model, "again") == list(STAGE_NAMES)  # the program cache's hit
    # A changed option: the program is compiled (capture runs; the stage cache serves what it can).
    assert "capture" not in _compile(tmp_path, model, "option", "--no-emit-extract-delegate-segments")
    source.write_text(MODEL_FILE.format(scale=2.0))  # the same weights, other example inputs
    assert "capture" not in _compile(tmp_path, model, "edited")
    # A module beside the model file may be imported by it, a data file read: a new one misses too.
    (tmp_path / "model" / "helper.py").write_text("SIZE = 4\n")
    assert "capture" not in _compile(tmp_path, model, "helper")
    assert _compile(tmp_path, model, "helper_again") == list(STAGE_NAMES)
    (tmp_path / "model" / "weights.bin").write_bytes(b"0")
    assert "capture" not in _compile(tmp_path, model, "data")


def test_the_files_a_run_writes_beside_its_model_file_are_not_in_its_key(tmp_path):
    source = tmp_path / "net.py"
    source.write_text(MODEL_FILE.format(scale=1.0))
    model = f"{source}:make"
    key = program_key(model, _config("portable"), written=[str(tmp_path / "r.json")])
    (tmp_path / "r.json").write_text("{}")
    (tmp_path / "net.pte").write_bytes(b"")
    assert program_key(model, _config("portable"), written=[str(tmp_path / "r.json")]) == key
    assert program_key(model, _config("portable")) != key


def test_a_corrupt_entry_is_compiled_again(tmp_path):
    assert _compile(tmp_path, MODEL, "cold") == []
    programs = _for_run({"cache_dir": str(tmp_path / "cache")})
    path = programs.cache.path(programs.key)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"garbage")
    assert programs.load() is None and not os.path.exists(path)
    assert "capture" not in _compile(tmp_path, MODEL, "again")
    assert (tmp_path / "again.pte").read_bytes() == (tmp_path / "cold.pte").read_bytes()
    assert programs.load() is not None  # stored again


def test_no_program_cache_while_a_fix_is_off_or_a_run_must_see_every_stage(tmp_path):
    from compiler.ir.fix_switches import fixes_off

    cache = {"cache_dir": str(tmp_path)}
    assert _for_run(cache) is not None
    assert _for_run({**cache, "stop_after": "lower"}) is None
    assert _for_run({**cache, "cache": False}) is None
    assert not _for_run({**cache, "dump_dir": str(tmp_path)}).cache.read
    assert not _for_run({**cache, "verify": False}).cache.write
    from compiler.ir.kernel_fixes import FIXES

    with fixes_off("cpu_kernels", next(iter(FIXES))):
        assert _for_run(cache) is None


def test_a_warm_sweep_starts_no_worker(tmp_path, monkeypatch):
    def in_this_process(jobs, workers, common, finished):
        for job in jobs:
            finished(job, sweeps.run_job(job, **common))

    jobs = [{"model": MODEL, "backend": "portable", "output": str(tmp_path / "{job}.pte")}]
    monkeypatch.setattr(sweeps, "_run_in_pool", in_this_process)
    [cold] = sweeps.sweep(jobs, cache_dir=str(tmp_path / "cache"))
    assert cold.passed and cold.cached_stages == ()
    first = (tmp_path / "1.pte").read_bytes()
    monkeypatch.setattr(sweeps, "_run_in_pool", pytest.fail)
    [warm] = sweeps.sweep(jobs, cache_dir=str(tmp_path / "cache"))
    assert warm.passed and warm.cached_stages == tuple(STAGE_NAMES) and warm.pte_bytes == len(first)
    assert (tmp_path / "1.pte").read_bytes() == first
    assert len([n for n in os.listdir(tmp_path / "cache") if n.endswith(ENTRY_SUFFIX)]) > 1


def test_a_run_that_checks_or_draws_the_html_report_is_not_served(tmp_path):
    """Both need what the program cache does not keep: the eager model, the partitioned program."""
    assert _compile(tmp_path, MODEL, "cold") == []
    assert "capture" not in _compile(tmp_path, MODEL, "checked", "--check")
    assert "capture" not in _compile(tmp_path, MODEL, "drawn", "--report-html", str(tmp_path / "r.html"))
    assert _compile(tmp_path, MODEL, "again") == list(STAGE_NAMES)
