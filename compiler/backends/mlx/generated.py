"""The MLX delegate's generated schema files, made on first use.

The ExecuTorch 1.5.1 wheel ships the MLX delegate's Python side without the
files its generator writes from `schema.fbs`, so importing the partitioner
fails with "MLX delegate generated files not found". The wheel does ship the
generator (`serialization/generate.py`) and `flatc`; stock `generate.py` writes
the Python bindings and then stops on two C++ templates only the C++ runtime
build needs, before it writes `_generated/__init__.py` and the inspector.

`ensure_generated()` makes exactly the Python files, with the generator's own
functions and the bundled `flatc`:

- once: when every file is there it returns at once, touching nothing;
- safely: under a file lock, into a temporary folder beside the package,
  then renamed into place one by one, `mlx_graph_schema.py` (the file the
  package checks for) last, so a reader never sees a half-written file;
- or not at all: when the package folder is not writable it raises
  `MLXSetupError` with the command to run as a user who can write there.

This is the one place this project writes inside site-packages.
`python -m compiler.backends.mlx.generated` runs it by hand.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import io
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from compiler.ir.errors import CompileError
from compiler.ir.private_api import MLX_GENERATED_PACKAGE, fixup_flatc_imports

SETUP_COMMAND = f"{Path(sys.executable).name} -m compiler.backends.mlx.generated"
_GENERATED_DIR = "_generated"
# Written last: ExecuTorch's `serialization/__init__.py` checks only for it.
_MARKER = "mlx_graph_schema.py"


class MLXSetupError(CompileError):
    """The MLX delegate's generated files are missing and cannot be made here."""


def serialization_dir() -> Path:
    """ExecuTorch's `backends/mlx/serialization` folder, found without importing it."""
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise MLXSetupError(
            "ExecuTorch is not installed",
            hint="pip install executorch (1.5.1 has the MLX delegate)",
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "backends" / "mlx" / "serialization"
    if not (folder / "schema.fbs").is_file() or not (folder / "generate.py").is_file():
        raise MLXSetupError(
            f"this ExecuTorch has no MLX delegate schema in {folder}",
            hint="install an ExecuTorch that ships executorch.backends.mlx (1.5.1 or later)",
        )
    return folder


def _outputs(folder: Path) -> dict[str, Path]:
    """Each generated Python file (or package), by the name it is generated under."""
    return {
        _GENERATED_DIR: folder / _GENERATED_DIR,
        "_generated_serializers.py": folder / "_generated_serializers.py",
        "_generated_inspector.py": folder.parent / "_generated_inspector.py",
        _MARKER: folder / _MARKER,
    }


def _present(name: str, path: Path) -> bool:
    if name == _GENERATED_DIR:  # the package is complete once its __init__ is written
        return (path / "__init__.py").is_file() and (path / "mlx_delegate").is_dir()
    return path.is_file()


def missing_files(folder: Path | None = None) -> list[Path]:
    folder = folder or serialization_dir()
    return [path for name, path in _outputs(folder).items() if not _present(name, path)]


def _flatc() -> Path:
    spec = importlib.util.find_spec("executorch")
    flatc = Path(next(iter(spec.submodule_search_locations))) / "data" / "bin" / "flatc"
    if not flatc.is_file():
        raise MLXSetupError(
            f"ExecuTorch's bundled flatc is missing ({flatc})",
            hint="reinstall executorch, or put flatc on PATH and run "
            "executorch/backends/mlx/serialization/generate.py --flatc $(which flatc)",
        )
    return flatc


def lock_path(folder: Path) -> Path:
    """The lock file for generating into `folder` (outside it: it may be read-only)."""
    key = hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"compiler-mlx-generate-{key}.lock"


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock for generating into `folder`, shared by every process here."""
    with open(lock_path(folder), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load_generator(folder: Path):
    """ExecuTorch's generate.py as a private module, so its paths can point elsewhere."""
    name = f"_compiler_mlx_generate_{os.getpid()}_{id(folder)}"
    spec = importlib.util.spec_from_file_location(name, folder / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while being built
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(name, None)
    return module


def _init_source(schema) -> str:
    """`_generated/__init__.py`: re-export every schema name from the flatc package."""
    names = sorted(
        [t.name for t in schema.tables]
        + [e.name for e in schema.enums]
        + [s.name for s in schema.structs]
        + [u.name for u in schema.unions]
    )
    lines = ["# Generated by compiler.backends.mlx.generated from schema.fbs; do not edit.", ""]
    lines += [f"from {MLX_GENERATED_PACKAGE}.{name} import {name}" for name in names]
    lines += ["", f"__all__ = {names!r}", ""]
    return "\n".join(lines)


def _generate_into(folder: Path, staging: Path) -> dict[str, Path]:
    """Write every generated file under `staging`; returns them by output name."""
    generator = _load_generator(folder)
    schema = generator.parse_fbs(folder / "schema.fbs")

    package = staging / _GENERATED_DIR
    package.mkdir()
    result = subprocess.run(
        [str(_flatc()), "--python", "-o", str(package), str(folder / "schema.fbs")],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise MLXSetupError(
            f"flatc could not generate the MLX schema bindings: {result.stderr.strip()}",
            hint=f"run {SETUP_COMMAND} to see the full error",
        )
    generator.GENERATED_DIR = package  # its import fix-up works on this folder
    with contextlib.redirect_stdout(io.StringIO()):  # it reports progress with print()
        fixup_flatc_imports(generator)
    (package / "__init__.py").write_text(_init_source(schema))

    made = {_GENERATED_DIR: package}
    for name, make in (
        ("_generated_serializers.py", generator.generate_python_serializers),
        ("_generated_inspector.py", generator.generate_inspector),
        (_MARKER, generator.generate_python_schema),
    ):
        made[name] = staging / name
        made[name].write_text(make(schema))
    _make_readable(staging)
    return made


def _make_readable(staging: Path) -> None:
    """Site-packages files are read by every user; flatc and mkdtemp make some private."""
    for root, dirs, files in os.walk(staging):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)


def _install(made: Path, target: Path, staging: Path) -> None:
    """Rename one generated file or package into place (atomic on one file system)."""
    if made.is_dir() and target.exists():
        # A package left incomplete (e.g. by stock generate.py): move it aside first.
        os.rename(target, staging / f"old{target.name}")
    os.replace(made, target)


def _not_writable(outputs: dict[str, Path]) -> list[Path]:
    folders = {path.parent for path in outputs.values()}
    return sorted(f for f in folders if not os.access(f, os.W_OK))


def ensure_generated(folder: Path | None = None) -> list[Path]:
    """Make the MLX delegate's generated Python files if any is missing; returns those made."""
    folder = folder or serialization_dir()
    if not missing_files(folder):
        return []
    outputs = _outputs(folder)
    blocked = _not_writable(outputs)
    if blocked:
        raise MLXSetupError(
            "the MLX delegate's generated schema files are missing "
            f"({', '.join(p.name for p in missing_files(folder))}) and "
            f"{', '.join(map(str, blocked))} is not writable",
            hint=f"run `{SETUP_COMMAND}` once as a user who can write there",
        )
    with _locked(folder):
        missing = {name for name, path in outputs.items() if not _present(name, path)}
        if not missing:  # another process made them while we waited
            return []
        staging = Path(tempfile.mkdtemp(prefix=".compiler-generate-", dir=folder))
        try:
            made = _generate_into(folder, staging)
            for name in outputs:  # dict order: the marker file last
                if name in missing:
                    _install(made[name], outputs[name], staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    importlib.invalidate_caches()
    return [outputs[name] for name in outputs if name in missing]


if __name__ == "__main__":
    try:
        made = ensure_generated()
    except CompileError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
    for path in made:
        print(f"generated {path}")
    if not made:
        print(f"the MLX delegate's generated files are present in {serialization_dir()}")
