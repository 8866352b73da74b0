"""The stage cache: hits give the same program, any change to what decides a stage misses
from that stage on, bad entries are rebuilt, writers share a folder, the size stays bounded."""

import json
import logging
import multiprocessing
import os

import pytest
import torch

import compiler
from compiler.driver import cache as stage_cache
from compiler.driver.cache import ENTRY_SUFFIX, StageCache
from compiler.cli.main import main
from compiler.driver import weight_store
from compiler.driver.config import STAGE_NAMES
from compiler.ir.program_data import SPILL_PROGRAM_BYTES
from compiler.ir.artifacts import ExecutorchProgram
from compiler.ir.placement import PlacementPlan
from compiler.reporting.report import StageRecord
from tiny_models import AddMul  # tests/tiny_models.py: a Linear XNNPACK takes and a cumsum it leaves

AFTER_CAPTURE = list(STAGE_NAMES[STAGE_NAMES.index("capture") + 1 :])


@pytest.fixture(autouse=True)
def store_every_stage(monkeypatch):
    """The tiny model's stages are quicker than writing them: store each one anyway."""
    monkeypatch.setattr(stage_cache, "STORE_AFTER_SECONDS", 0.0)


def _model():
    torch.manual_seed(0)
    return AddMul().eval(), (torch.randn(2, 8),)


def _cached(artifact):
    return [r.stage for r in artifact.report.stages if r.cached]


def _entries(folder):
    return sorted(name for name in os.listdir(folder) if name.endswith(ENTRY_SUFFIX))


def _coreml_reproducible(model, inputs) -> bool:
    first = compiler.compile(model, inputs, "coreml")
    return first.pte == compiler.compile(model, inputs, "coreml").pte


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "coreml"])
def test_a_hit_gives_the_same_program_and_reports_cached_stages(tmp_path, backend):
    model, inputs = _model()
    if backend == "coreml" and not _coreml_reproducible(model, inputs):
        pytest.skip("Core ML's .pte is not byte-reproducible yet")
    cold = compiler.compile(model, inputs, backend, cache_dir=str(tmp_path))
    assert _cached(cold) == []
    assert len(_entries(tmp_path)) == len(AFTER_CAPTURE)

    warm = compiler.compile(model, inputs, backend, cache_dir=str(tmp_path))
    assert warm.pte == cold.pte
    assert _cached(warm) == AFTER_CAPTURE
    for stage in AFTER_CAPTURE:
        row, ran = warm.report.stage(stage), cold.report.stage(stage)
        assert row.saved_seconds == pytest.approx(ran.seconds + ran.verify_seconds)
        assert (row.nodes_in, row.nodes_out, row.delegates, row.cpu_ops) == (ran.nodes_in, ran.nodes_out, ran.delegates, ran.cpu_ops)
        assert row.metrics == json.loads(json.dumps(ran.metrics))
    assert "cached, saved" in warm.report.format_stages()
    stages = json.loads(json.dumps(warm.report.to_json()))["stages"]
    assert [s["stage"] for s in stages if s["cached"]] == AFTER_CAPTURE
    assert all(s["saved_seconds"] is not None for s in stages if s["cached"])
    assert warm.program.operators == cold.program.operators and warm.program.plan == cold.program.plan


def _bfloat16_mlp():
    from compiler.models.examples import mlp

    model, (x,) = mlp()
    return model.to(torch.bfloat16), (x.to(torch.bfloat16),)


def _checked_cold_and_hit(tmp_path, **options):
    """The check of a bfloat16 model compiled for XNNPACK (which computes it in float32), cold and
    on a hit (where the cache stood in for the precision stage, whose program is the reference)."""
    model, inputs = _bfloat16_mlp()
    cold, hit = (compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path), **options) for _ in range(2))
    assert "precision" in _cached(hit) and "precision" not in hit.stages
    return [compiler.compare_with_eager(result, model, inputs).to_json() for result in (cold, hit)]


def test_a_hit_is_checked_against_the_same_reference_as_the_cold_run(tmp_path):
    # It was the model cast to float32, returning float32 where the program rounds to bfloat16 as
    # the precision stage's program does: a figure of its own (0.00742 against 0.00391 on a Llama).
    cold, hit = _checked_cold_and_hit(tmp_path)
    assert cold["passed"] and cold["reference"] == "the eager model in float32"
    assert hit == cold


def test_a_hit_of_a_quantized_bfloat16_program_is_checked_against_the_eager_quantized_model(tmp_path):
    # The eager quantized model cast to float32 crashed ("expected m1 and m2 to have the same dtype,
    # but got: float != c10::BFloat16"): TorchAO's weights keep their bfloat16 scales.
    cold, hit = _checked_cold_and_hit(tmp_path, quantize="8da4w")
    assert cold["passed"] and cold["reference"] == "the eager quantized model in float32"
    assert hit == cold


def test_the_key_covers_every_source_file_of_the_compiler():
    """An edited stage or backend must miss: the compiler's version in every key digests the
    whole package's sources, not only the cache module's own folder."""
    package = os.path.dirname(os.path.abspath(compiler.__file__))
    sources = {
        os.path.relpath(os.path.join(folder, name), package)
        for folder, dirs, files in os.walk(package)
        if "__pycache__" not in folder
        for name in files
        if name.endswith(".py")
    }
    assert {"stages/fold.py", "backends/mlx/support.py", "driver/cache.py", "api.py"} <= sources
    assert set(stage_cache.source_files()) == sources


def test_the_api_caches_only_with_a_folder_and_not_when_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    model, inputs = _model()
    compiler.compile(model, inputs, "portable")
    assert not (tmp_path / "xdg").exists()
    compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path / "off"), cache=False)
    assert not (tmp_path / "off").exists() or _entries(tmp_path / "off") == []


def test_a_compile_with_a_fix_switched_off_neither_reads_nor_stores_the_cache(tmp_path):
    """The key does not hold the test-only fix switches: a payload made without a fix must not
    be given to a later run with it, nor a cached one (made with it) to a run testing without it."""
    from compiler.backends.coreml.fixes import fixes_off

    model, inputs = torch.nn.GELU(approximate="tanh").eval(), (torch.linspace(-4, 4, 64).reshape(1, 64),)
    fixed = compiler.compile(model, inputs, "coreml", cache_dir=str(tmp_path))
    stored = _entries(tmp_path)
    with fixes_off("tanh_gelu"):
        broken = compiler.compile(model, inputs, "coreml", cache_dir=str(tmp_path))
    assert _cached(broken) == [] and _entries(tmp_path) == stored
    assert broken.pte != fixed.pte  # made without the fix, not read from the cache


def test_a_changed_weight_misses_every_stage(tmp_path):
    model, inputs = _model()
    compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path))
    with torch.no_grad():
        model.linear.weight[0, 0] += 1.0
    changed = compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path))
    assert _cached(changed) == []
    assert changed.pte != compiler.compile(*_model(), "xnnpack").pte


@pytest.mark.parametrize(
    "option, hits",
    [
        ({"emit_stacktrace": True}, AFTER_CAPTURE[:-1]),  # only emit reruns
        ({"dry_run_mode": "always"}, ["precision", "fold"]),  # dry run and after rerun
        ({"fold_skip_ops": ("aten.t.default",)}, ["precision"]),  # fold and after rerun
        ({"precision": "float32"}, []),  # everything after capture reruns
    ],
)
def test_a_changed_stage_option_misses_from_that_stage_on(tmp_path, option, hits):
    model, inputs = _model()
    compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path))
    changed = compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path), **option)
    assert _cached(changed) == hits
    again = compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path), **option)
    assert _cached(again) == AFTER_CAPTURE and again.pte == changed.pte


def test_another_backend_or_backend_option_misses(tmp_path):
    model, inputs = _model()
    compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path))
    assert _cached(compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path))) == []
    other = compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path), backend_options={"per_op_mode": True})
    assert _cached(other) == []


@pytest.mark.parametrize("patched", ["dependency_versions", "project_version"])
def test_a_changed_version_misses(tmp_path, monkeypatch, patched):
    model, inputs = _model()
    compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path))
    if patched == "dependency_versions":
        versions = stage_cache.dependency_versions()
        monkeypatch.setattr(stage_cache, "dependency_versions", lambda: {**versions, "torch": "0.0.1"})
    else:
        version = stage_cache.project_version()
        monkeypatch.setattr(stage_cache, "project_version", lambda: version + "-edited")
    assert _cached(compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path))) == []


def test_the_project_version_follows_the_compiler_sources():
    assert stage_cache.project_version().startswith("0.") and "+" in stage_cache.project_version()


def test_corrupt_entries_are_logged_ignored_and_rebuilt(tmp_path, caplog):
    model, inputs = _model()
    cold = compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path))
    cache = StageCache(tmp_path, 2**30)
    keys = cache.keys(cold.stages["capture"], AFTER_CAPTURE, compiler.CompileConfig(backend="xnnpack"))
    emit, lower = cache.path(keys["emit"]), cache.path(keys["lower"])
    with open(emit, "r+b") as f:  # garble the .pte's middle: the zip's checksum refuses it
        data = bytearray(f.read())
        start = data.index(cold.pte[:64])
        data[start + 100 : start + 200] = bytes(100)
        f.seek(0)
        f.write(data)
    with open(lower, "r+b") as f:  # truncate the lowered program
        f.truncate(os.path.getsize(lower) // 2)

    with caplog.at_level(logging.WARNING, logger="compiler.driver.cache"):
        rebuilt = compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path))
    assert rebuilt.pte == cold.pte
    assert _cached(rebuilt) == AFTER_CAPTURE[: AFTER_CAPTURE.index("split_constants") + 1]
    warnings = [r.getMessage() for r in caplog.records if r.name == "compiler.driver.cache"]
    assert any("for emit" in w for w in warnings) and any("for lower" in w for w in warnings), warnings
    again = compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path))
    assert _cached(again) == AFTER_CAPTURE and again.pte == cold.pte


def test_runs_that_must_see_every_stage_store_but_do_not_load(tmp_path):
    model, inputs = _model()
    compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path / "cache"))
    dumped = compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path / "cache"), dump_dir=str(tmp_path / "d"))
    assert _cached(dumped) == []
    assert (tmp_path / "d" / "09-lower.stage").exists()
    fresh = compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path / "other"), dump_dir=str(tmp_path / "d2"))
    assert _cached(fresh) == [] and len(_entries(tmp_path / "other")) == len(AFTER_CAPTURE)
    resumed = compiler.compile(
        None, resume_from=str(tmp_path / "d" / "06-decompose.stage"), cache_dir=str(tmp_path / "cache")
    )
    assert _cached(resumed) == [] and resumed.pte == dumped.pte


def test_stop_after_loads_the_stage_it_stops_at(tmp_path):
    model, inputs = _model()
    compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path))
    result = compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path), stop_after="partition")
    assert [r.stage for r in result.report.stages if r.cached] == ["precision", "fold", "dry_run", "decompose", "partition"]
    assert type(result.artifact).__name__ == "PartitionedProgram" and result.stages["partition"] is result.artifact


def _program(size: int, fill: int) -> ExecutorchProgram:
    return ExecutorchProgram(bytes([fill]) * size, ("aten::add.out",), (), PlacementPlan(()), 1, 0)


def _store(folder: str, keys: list[str], fill: int, barrier) -> None:
    cache = StageCache(folder, 2**30)
    barrier.wait(60)  # both start writing at once, after their imports
    for key in keys:
        cache.store(key, "emit", _program(1 << 20, fill), StageRecord("emit", 1.0), compiler.CompileConfig())


@pytest.mark.slow
def test_concurrent_writers_of_one_key_leave_one_valid_entry(tmp_path):
    keys = [f"{i:064x}" for i in range(8)]
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    workers = [context.Process(target=_store, args=(str(tmp_path), keys, fill, barrier)) for fill in (1, 2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    assert sorted(os.listdir(tmp_path)) == _entries(tmp_path) and len(_entries(tmp_path)) == len(keys)  # no temporary files left
    cache = StageCache(tmp_path, 2**30)
    for key in keys:
        hit = cache.lookup({"emit": key})
        assert hit is not None and len(hit.artifact.pte) == 1 << 20 and len(set(hit.artifact.pte)) == 1


def test_least_recently_used_entries_are_evicted_beyond_the_limit(tmp_path):
    entry = 100_000
    cache = StageCache(tmp_path, int(3.5 * entry))
    for i, key in enumerate(("a" * 64, "b" * 64, "c" * 64)):
        cache.store(key, "emit", _program(entry, i), StageRecord("emit", 1.0), compiler.CompileConfig())
        os.utime(cache.path(key), (1000 + i, 1000 + i))
    assert cache.lookup({"emit": "a" * 64}) is not None  # a hit makes it the most recently used
    cache.store("d" * 64, "emit", _program(entry, 3), StageRecord("emit", 1.0), compiler.CompileConfig())
    assert _entries(tmp_path) == [k * 64 + ENTRY_SUFFIX for k in "acd"]
    assert sum(os.path.getsize(tmp_path / name) for name in _entries(tmp_path)) <= cache.max_bytes


def test_the_cli_caches_in_the_user_cache_folder_unless_told_otherwise(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    default = tmp_path / "xdg" / "staged-compiler" / "stages"
    report = tmp_path / "report.json"

    def cached(*flags):
        assert main(["compile", "mlp", "--backend", "portable", "--report-json", str(report), *flags]) == 0
        return [s["stage"] for s in json.loads(report.read_text())["stages"] if s["cached"]]

    assert cached("--no-cache") == []
    assert not default.exists() or _entries(default) == []
    # Each stage's entry and the program cache's (which then serves the whole compile).
    assert cached() == []
    assert len(_entries(default)) == len(AFTER_CAPTURE) + 1
    assert cached() == list(STAGE_NAMES)
    assert cached("--no-cache") == []
    assert cached("--cache-dir", str(tmp_path / "mine")) == []
    assert len(_entries(tmp_path / "mine")) == len(AFTER_CAPTURE) + 1
    assert cached("--cache-dir", str(tmp_path / "mine")) == list(STAGE_NAMES)
    printed = capsys.readouterr()
    assert "cached, saved" in printed.out + printed.err


def test_quick_stages_store_only_their_report_row(tmp_path, monkeypatch):
    monkeypatch.setattr(stage_cache, "STORE_AFTER_SECONDS", 1e9)
    model, inputs = _model()
    cold = compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path))
    sizes = sorted(os.path.getsize(tmp_path / name) for name in _entries(tmp_path))
    assert len(sizes) == len(AFTER_CAPTURE) and sizes[-2] < 4096 < sizes[-1]  # only emit's output is stored
    warm = compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path))
    assert _cached(warm) == AFTER_CAPTURE and warm.pte == cold.pte
    assert warm.report.stage("lower").saved_seconds == pytest.approx(
        cold.report.stage("lower").seconds + cold.report.stage("lower").verify_seconds
    )
    # Only the row of lower is stored: a changed emit option reruns every stage, then stores lower.
    monkeypatch.setattr(stage_cache, "STORE_AFTER_SECONDS", 0.0)
    assert _cached(compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path), emit_extract_delegate_segments=False)) == []
    again = compiler.compile(model, inputs, "xnnpack", cache_dir=str(tmp_path), emit_extract_delegate_segments=False)
    assert _cached(again) == AFTER_CAPTURE


@pytest.mark.slow
def test_a_fresh_process_emits_from_a_cached_core_ml_lowering(tmp_path):
    """A delegate's original program keeps its ops kept whole (layer_norm) when loaded: a copy
    of the delegate verifies it again (in a fresh process, nothing else allows them)."""
    import subprocess
    import sys

    def arguments(*flags):
        return ["compile", "transformer:depth=1,dim=32", "--backend", "coreml",
                "--cache-dir", str(tmp_path / "cache"), "--report-json", str(tmp_path / "r.json"), *flags]

    def cached():
        return [s["stage"] for s in json.loads((tmp_path / "r.json").read_text())["stages"] if s["cached"]]

    # The cold compile fills the cache here, in this process (store_every_stage stores each stage);
    # only the one loading from it must be a fresh process.
    assert main(arguments()) == 0
    assert cached() == []
    # The CLI in a fresh process, storing every stage (this model's stages are quick).
    script = ("import sys; from compiler.driver import cache; from compiler.cli.main import main; "
              f"cache.STORE_AFTER_SECONDS = 0.0; sys.exit(main({arguments('--no-emit-extract-delegate-segments')!r}))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert cached() == AFTER_CAPTURE[:-1]


class _Wide(torch.nn.Module):
    """Two 1 MB Linears (weights the store keeps apart from the entries) and a cumsum (on the CPU)."""

    def __init__(self, width: int = 512):
        super().__init__()
        self.first = torch.nn.Linear(width, width)
        self.second = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.cumsum(self.second(torch.relu(self.first(x))), dim=-1)


def _store_bytes(folder) -> int:
    store = folder / weight_store.FOLDER
    return sum(os.path.getsize(store / name) for name in os.listdir(store))


def _weight_bytes(model) -> int:
    """The bytes of the weights large enough for the store (the biases stay in the entries)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values() if weight_store.storable(t))


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_each_weight_is_stored_once_across_stages_and_runs(tmp_path, backend):
    torch.manual_seed(0)
    model, inputs = _Wide().eval(), (torch.randn(4, 512),)
    weights = _weight_bytes(model)
    cold = compiler.compile(model, inputs, backend, cache_dir=str(tmp_path))
    entries = sum(os.path.getsize(tmp_path / name) for name in _entries(tmp_path))
    stored = _store_bytes(tmp_path)
    # Nine entries holding the weights each would be 9x; they hold references and the emitted program.
    assert entries < weights + 2 * len(cold.pte), (entries, weights)
    # XNNPACK's payload keeps the weights as named data: the same bytes as the tensors, or its own packing.
    assert weights <= stored <= 2 * weights, (stored, weights)
    warm = compiler.compile(model, inputs, backend, cache_dir=str(tmp_path))
    assert _cached(warm) == AFTER_CAPTURE and warm.pte == cold.pte
    assert _store_bytes(tmp_path) == stored  # the second run stored nothing new


def _mapped_files() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if len(line.split()) >= 6}


def test_a_hit_maps_its_weights_from_the_store_and_a_damaged_weight_is_rebuilt(tmp_path, caplog):
    torch.manual_seed(0)
    model, inputs = _Wide().eval(), (torch.randn(4, 512),)
    cold = compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path), stop_after="partition")
    warm = compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path), stop_after="partition")
    assert _cached(warm)[-1] == "partition"
    program = warm.artifact.program
    store = str(tmp_path / weight_store.FOLDER)
    first = program.state_dict["first.weight"]
    assert torch.equal(first, model.first.weight) and isinstance(first, torch.nn.Parameter)
    assert any(path.startswith(store) for path in _mapped_files())  # mapped, not read
    assert all(torch.equal(program.state_dict[k], v) for k, v in cold.artifact.program.state_dict.items())
    for name in os.listdir(store):  # every weight truncated: a wrong number must never be loaded
        os.chmod(os.path.join(store, name), 0o644)
        with open(os.path.join(store, name), "r+b") as f:
            f.truncate(1000)
    with caplog.at_level(logging.WARNING, logger="compiler.driver.cache"):
        rebuilt = compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path))
    assert any("holds 1000 bytes" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert rebuilt.pte == compiler.compile(model, inputs, "portable").pte


def test_a_large_program_is_stored_once_and_saved_as_a_copy(tmp_path):
    """A program of SPILL_PROGRAM_BYTES or more is a file in the store; saving a hit must copy it
    (a link would let a user's later write to the saved file change the cache)."""
    torch.manual_seed(0)
    model, inputs = _Wide(1536).eval(), (torch.randn(4, 1536),)
    cold = compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path))
    assert len(cold.program.data) >= SPILL_PROGRAM_BYTES
    warm = compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path))
    assert _cached(warm) == AFTER_CAPTURE
    assert warm.program.data.path.startswith(str(tmp_path / weight_store.FOLDER))
    (saved,) = warm.save(tmp_path / "model.pte")
    assert os.stat(saved).st_ino != os.stat(warm.program.data.path).st_ino
    assert open(saved, "rb").read() == cold.pte


def test_an_output_larger_than_the_cache_is_not_stored(tmp_path, caplog):
    """A real-size model's stage outputs would be written only to be evicted again: each is over
    the limit, so none is written (and the compile says why, at info)."""
    torch.manual_seed(0)
    model, inputs = _Wide().eval(), (torch.randn(4, 512),)  # 2 MB of weights
    with caplog.at_level(logging.INFO, logger="compiler.driver.cache"):
        compiler.compile(model, inputs, "portable", cache_dir=str(tmp_path), cache_max_mb=1)
    assert _entries(tmp_path) == [] or all(os.path.getsize(tmp_path / e) < 2**20 for e in _entries(tmp_path))
    assert not (tmp_path / weight_store.FOLDER).exists()
    assert any("over the cache's limit" in r.getMessage() for r in caplog.records)
