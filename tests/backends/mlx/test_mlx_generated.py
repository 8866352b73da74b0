"""The MLX delegate's generated schema files: made on first use, once, safely."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from compiler import backends
from compiler.backends.mlx import generated
from compiler.backends.mlx.generated import MLXSetupError, ensure_generated, missing_files


@pytest.fixture
def fresh_package(tmp_path):
    """A copy of the wheel's MLX serialization folder as the wheel ships it (nothing generated)."""
    source = generated.serialization_dir()
    folder = tmp_path / "mlx" / "serialization"
    folder.mkdir(parents=True)
    for name in ("schema.fbs", "generate.py"):
        shutil.copy(source / name, folder / name)
    yield folder
    generated.lock_path(folder).unlink(missing_ok=True)


def _mtimes(folder: Path) -> dict[str, int]:
    return {
        str(p.relative_to(folder.parent)): p.stat().st_mtime_ns
        for p in folder.parent.rglob("*")
        if "__pycache__" not in p.parts
    }


def test_backend_is_usable_from_the_wheel():
    backends.resolve("mlx")
    assert missing_files() == []
    from executorch.backends.mlx.partitioner import MLXPartitioner  # noqa: F401  (imports now)


def test_generation_makes_the_python_files_once(fresh_package):
    made = ensure_generated(fresh_package)
    assert sorted(p.name for p in made) == sorted(
        ["_generated", "_generated_serializers.py", "_generated_inspector.py", "mlx_graph_schema.py"]
    )
    assert missing_files(fresh_package) == []
    assert (fresh_package / "_generated" / "mlx_delegate" / "MLXGraph.py").is_file()
    # Only the Python side: nothing for the C++ runtime build, no staging folder left behind.
    assert not (fresh_package.parent / "runtime").exists()
    assert not [p for p in fresh_package.iterdir() if p.name.startswith(".compiler-generate-")]

    before = _mtimes(fresh_package)
    assert ensure_generated(fresh_package) == []
    assert _mtimes(fresh_package) == before


def test_generation_repairs_what_the_stock_generator_leaves(fresh_package):
    # Stock generate.py stops on the C++ templates before writing these two.
    ensure_generated(fresh_package)
    (fresh_package / "_generated" / "__init__.py").unlink()
    (fresh_package.parent / "_generated_inspector.py").unlink()
    schema_mtime = (fresh_package / "mlx_graph_schema.py").stat().st_mtime_ns

    made = ensure_generated(fresh_package)
    assert sorted(p.name for p in made) == ["_generated", "_generated_inspector.py"]
    assert missing_files(fresh_package) == []
    assert (fresh_package / "mlx_graph_schema.py").stat().st_mtime_ns == schema_mtime


_RACER = """
import sys, time
from pathlib import Path
from compiler.backends.mlx.generated import ensure_generated
folder, barrier, me = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
(barrier / me).touch()
while len(list(barrier.iterdir())) < 2:  # both imported: call together
    time.sleep(0.002)
print(len(ensure_generated(folder)))
"""


@pytest.mark.slow
def test_two_processes_racing_both_succeed(fresh_package, tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(fresh_package), str(barrier), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[3],
        )
        for i in range(2)
    ]
    results = [r.communicate(timeout=120) for r in racers]
    assert [r.returncode for r in racers] == [0, 0], [err[-2000:] for _, err in results]
    made = sorted(int(out.strip().splitlines()[-1]) for out, _ in results)
    assert made == [0, 4]  # one made all four, the other found them made
    assert missing_files(fresh_package) == []


def test_unwritable_package_says_what_to_run(fresh_package, monkeypatch):
    monkeypatch.setattr(generated.os, "access", lambda path, mode: False)
    with pytest.raises(MLXSetupError) as err:
        ensure_generated(fresh_package)
    message = str(err.value)
    assert "not writable" in message and str(fresh_package) in message
    assert "-m compiler.backends.mlx.generated" in message
    assert not (fresh_package / "mlx_graph_schema.py").exists()


def test_present_files_need_no_write_access(fresh_package, monkeypatch):
    ensure_generated(fresh_package)
    monkeypatch.setattr(generated.os, "access", lambda path, mode: False)
    assert ensure_generated(fresh_package) == []
