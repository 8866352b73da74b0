"""The program cache: a whole compile's `.pte` and report, keyed before anything is built.

The stage cache (`compiler.driver.cache`) keys stages by what capture exported, so even a
full hit pays for torch.export and for importing torch and ExecuTorch: seconds of a fresh
process that only wants a program it made before. When the model is named by a MODEL spec
(the CLI's and a sweep's), the key is computed from text instead: the spec (a built-in
example and its parameters, whose source is the compiler's), for `path.py:factory` the
file's bytes, the bytes of the `.py` files beside it (modules it may import) and the name,
size and mtime of the other files beside it (data it may read; the files the run itself
writes and any `.pte`, `.stage` or `.html` are left out), then the compile configuration, the backend
and its options, the dynamic sizes, the calibration (a file's bytes, or the number of
draws), the dependency versions, Python's, and this compiler's version (its package
version and a digest of its sources). A hit gives the program and the report (every stage
marked cached) without importing torch, ExecuTorch or any backend, and without building
the model.

A factory whose output depends on anything else (files in other folders, the network, the
environment, unseeded randomness) is not seen by the key: compile it with `--no-cache`.

Entries are `<key>.entry` files of the stage cache's folder, so they share its size limit
and eviction, and follow its rules (`StageCache.for_run`): no cache while a fix is switched
off, nothing read by a run that must see every stage (dump_dir, print_after_change),
nothing written by a run without verify. Only whole compiles are keyed (no stop_after,
no resume_from); the caller decides which runs it serves (the CLI: none that check
against eager or draw the HTML report's graph). An entry that does not load is logged and removed, and the compile runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
import zipfile
from typing import Any, Mapping, Sequence

import attrs

from compiler.driver import cache as stage_cache
from compiler.driver.config import CompileConfig, DriverOptions, dependency_versions
from compiler.ir.program_data import ProgramData, program_data, save_program
from compiler.reporting.report import Report, StageRecord

logger = logging.getLogger(__name__)

# Bumped when the key recipe or the entry layout changes: older entries then never match.
PROGRAM_FORMAT = 1
# The entry's stage name (no pipeline stage has it).
PROGRAM = "program"
_PTE = "program.pte"
_PTD = "program.ptd"
# Decide a program beyond `dependency_versions()`: quantization (torchao), the model suite (transformers).
_MODEL_DEPENDENCIES = ("torchao", "transformers")
# What a compile writes beside a model file: not what its factory reads.
_WRITTEN_SUFFIXES = (".pte", ".stage", ".html")


@attrs.frozen
class CachedProgram:
    """A program cache hit: the `.pte` and report of an earlier compile of the same key
    (`pte`, `save`, `report`, `stopped_after` and `stages` as a `CompileResult`'s; no stage's
    artifact, as no stage ran)."""

    data: ProgramData = attrs.field(converter=program_data)
    report: Report
    stages: Mapping[str, Any] = attrs.field(factory=dict)
    weights: ProgramData | None = attrs.field(default=None, converter=attrs.converters.optional(program_data))

    @property
    def pte(self) -> bytes:
        return self.data.read()

    @property
    def program(self) -> "CachedProgram":
        """What a `CompileResult`'s `program` gives: the `.pte` and its data file."""
        return self

    @property
    def stopped_after(self) -> str:
        return self.report.stages[-1].stage

    def save(self, path: str | os.PathLike) -> tuple[str, ...]:
        return save_program(path, self.data, self.weights)


def _digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _model_key(spec: str, written: Sequence[str]) -> dict[str, Any]:
    """What decides the model a MODEL spec builds (as `compiler.models.catalog` reads specs);
    `written`: the files the run writes, which its factory does not read."""
    head, _, factory = spec.partition(":")
    if os.path.isdir(head):  # a checkpoint: its files as they are on disk, and the task
        files = sorted(os.listdir(head))
        stats = [(n, os.stat(os.path.join(head, n)).st_size, os.stat(os.path.join(head, n)).st_mtime_ns) for n in files]
        return {"checkpoint": os.path.abspath(head), "task": factory, "files": stats}
    if not (head.endswith(".py") or os.sep in head):
        return {"example": head, "arguments": factory}  # its source is in the compiler's digest
    folder = os.path.dirname(os.path.abspath(head))
    ours = {os.path.abspath(path) for path in written}
    beside = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith(".") or name.endswith(_WRITTEN_SUFFIXES) or path in ours or not os.path.isfile(path):
            continue
        if name.endswith(".py"):
            beside.append((name, _digest(path)))
        else:
            info = os.stat(path)
            beside.append((name, info.st_size, info.st_mtime_ns))
    return {"file": _digest(head), "factory": factory, "beside": beside}


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    found = dict(dependency_versions())
    for name in _MODEL_DEPENDENCIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def program_key(
    model: str,
    config: CompileConfig,
    dynamic_dim: Sequence[Any] = (),
    calibration: str | int | None = None,
    written: Sequence[str] = (),
) -> str | None:
    """The key of a whole compile of the MODEL spec `model` with `config` (`calibration`: a
    calibration file's path or a number of draws; `written`: the files the run writes); None
    (logged) when it cannot be keyed."""
    data = config.to_json()
    if data.get("unrecorded"):
        logger.info("program cache not used: backend option(s) %s cannot be recorded", ", ".join(sorted(data["unrecorded"])))
        return None
    try:
        model_key = _model_key(model, written)
        if isinstance(calibration, str):
            calibration = _digest(calibration)
    except OSError as exc:
        logger.info("program cache not used: %s", exc)
        return None
    return stage_cache.hash_key({
        "format": PROGRAM_FORMAT,
        "stage": PROGRAM,
        "model": model_key,
        "config": data,
        "dynamic_dim": [str(dim) for dim in dynamic_dim],
        "calibration": calibration,
        "versions": _versions(),
        "python": [platform.python_version(), platform.machine()],
        "project": stage_cache.project_version(),
    })


class ProgramCache:
    """One compile's use of the program cache: its key in a stage cache's folder."""

    def __init__(self, cache: stage_cache.StageCache, key: str) -> None:
        self.cache, self.key = cache, key

    @classmethod
    def for_run(
        cls,
        model: str,
        config: CompileConfig,
        driving: DriverOptions,
        dynamic_dim: Sequence[Any] = (),
        calibration: str | int | None = None,
        written: Sequence[str] = (),
    ) -> "ProgramCache | None":
        """The program cache of a compile of `model` with `config` and the run's options
        `driving` (the rest as `program_key`'s), or None when the run is not cached or not keyed."""
        cache = stage_cache.StageCache.for_run(driving)
        if cache is None or driving.stop_after:
            return None
        key = program_key(model, config, dynamic_dim, calibration, written)
        return cls(cache, key) if key is not None else None

    def load(self) -> CachedProgram | None:
        """The program stored under this key, or None (a missing or unreadable entry)."""
        path = self.cache.path(self.key)
        if not self.cache.read or not os.path.exists(path):
            return None
        start = time.perf_counter()
        try:
            with zipfile.ZipFile(path) as archive:
                meta = stage_cache.read_meta(archive, PROGRAM, self.key)
                pte = stage_cache.read_program(archive, _PTE, meta, self.cache.weights)
                weights = stage_cache.read_program(archive, _PTD, meta, self.cache.weights)
            report = _report(meta["report"], time.perf_counter() - start)
        except Exception as exc:
            logger.warning("program cache: ignoring the unreadable entry %s (%s: %s); compiling",
                           os.path.basename(path), type(exc).__name__, exc)
            stage_cache.remove(path)
            return None
        stage_cache.touch(path)
        logger.info("program cache: loaded the program in %.3f s; no stage runs", time.perf_counter() - start)
        return CachedProgram(pte, report, weights=weights)

    def store(self, program: Any, report: Report) -> bool:
        """Stores a whole compile's program (its `.pte` and data file) and report; False when not written."""
        if not self.cache.write:
            return False
        rows = []
        for record in report.stages:
            row = attrs.asdict(record)
            row.pop("messages")
            rows.append(row)
        meta = {
            "format": stage_cache.CACHE_FORMAT, "key": self.key, "stage": PROGRAM, "artifact": PROGRAM,
            "report": {"stages": rows, "config": dict(report.config), "versions": dict(report.versions),
                       "plan": report.plan.to_json() if report.plan is not None else None},
        }
        members = stage_cache.program_members(meta, {_PTE: program.data, _PTD: program.weights}, self.cache.weights)
        return self.cache.write_entry(self.key, "the program", lambda temp: stage_cache.write_zip(temp, members))


def _report(data: Mapping[str, Any], seconds: float) -> Report:
    """The stored report with every stage marked cached: the load's time on the last row, and
    each row's own run and verify time (or what it saved itself) as what it saved."""
    from compiler.ir.placement import PlacementPlan

    rows = data["stages"]
    records = []
    for index, row in enumerate(rows):
        saved = (row["saved_seconds"] or 0.0) if row["cached"] else row["seconds"] + row["verify_seconds"]
        records.append(StageRecord(**{
            **row, "seconds": seconds if index == len(rows) - 1 else 0.0, "verify_seconds": 0.0,
            "cached": True, "saved_seconds": saved,
        }))
    plan = PlacementPlan.from_json(data["plan"], for_report=True) if data["plan"] is not None else None
    return Report(tuple(records), plan.summary() if plan else (), data["config"], data["versions"], plan=plan)
