"""The stage cache: a stage's output stored under a hash of everything that decides it.

Keys chain. Capture always runs; the hash of what it exported (graph, signature, range
constraints, every weight's bytes) seeds the chain, and the key of each later stage's
output is the hash of its input's key, the stage's name and options, the backend and its
options, the dependency versions and this compiler's own version (its package version
and a digest of its sources, so an edited checkout never trusts old entries). Right
after capture the driver therefore knows every later key, loads only the last stage
whose entry exists and resumes after it; the stages before it are reported as cached
too, with the numbers and the time their entries recorded.

An entry is one file, `<key>.entry`: a stage file (`compiler.driver.stage_files`) for the
resumable artifacts, a zip of the `.pte` and its fields for emit's program; both hold a
JSON member with the stage's report row. Large weights, payloads and programs are not in the
entry: they are stored once by content in the folder's weight store (`weight_store`), which
every entry and run shares, and a hit maps them from there. A quick stage's output is not worth writing
(`STORE_AFTER_SECONDS`): its entry holds only the row, and a later compile reruns it
from the last stored output before it. Writes go to a temporary file in the cache
folder and are renamed into place, so processes may share one folder. An entry that
does not load is logged, removed and rebuilt, never trusted. After each write the
least recently used entries (a hit touches an entry's mtime) go until the folder is
under its size limit (the weight store's files count, and go the same way).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time
import zipfile
from typing import Any, Callable, Mapping, Sequence

import attrs

from compiler.driver.config import CompileConfig, DriverOptions, dependency_versions
from compiler.driver.weight_store import WeightStore
from compiler.ir.program_data import SPILL_PROGRAM_BYTES, ProgramData

logger = logging.getLogger(__name__)

# Bumped when the key recipe or the entry layout changes: older entries then never match.
CACHE_FORMAT = 2
ENTRY_SUFFIX = ".entry"
META = "cache_entry.json"
_PTE = "program.pte"
_PTD = "program.ptd"
_TEMP_PREFIX = ".tmp-"
# A stage's output is stored when the stages since the last stored one took at least this
# long (run and verify); otherwise its entry holds only its report row (writing a large
# program costs more than rerunning a quick stage). The last stage's output is always stored.
STORE_AFTER_SECONDS = 1.0
# A temporary file older than this was left by a process that died mid-write.
_STALE_TEMP_SECONDS = 3600.0


def default_cache_dir() -> str:
    """The CLI's stage cache: `$XDG_CACHE_HOME/staged-compiler/stages`, else `~/.cache/...`."""
    from compiler.driver.instruments import user_cache_folder

    return user_cache_folder("stages")


# The compiler package (this module is in its driver layer): every source file in it decides outputs.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_files() -> list[str]:
    """The compiler's Python sources, relative to its package folder, in a fixed order."""
    found = []
    for folder, dirs, files in os.walk(_PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        found += [os.path.relpath(os.path.join(folder, f), _PACKAGE) for f in sorted(files) if f.endswith(".py")]
    return found


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    digest = hashlib.sha256()
    for relative in source_files():
        digest.update(relative.encode() + b"\0")
        with open(os.path.join(_PACKAGE, relative), "rb") as f:
            digest.update(f.read())
        digest.update(b"\0")
    return digest.hexdigest()


def project_version() -> str:
    """This compiler's version: the package's, and a digest of its Python sources."""
    from importlib import metadata

    try:
        version = metadata.version("staged-compiler")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"{version}+{_source_digest()[:16]}"


def _value_text(value: Any) -> str:
    """A node's value as text: a tensor's dtype, shape, strides and grad flag; symbols by name."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"T({value.dtype},{tuple(value.shape)},{tuple(value.stride())},{value.requires_grad})"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value_text(v) for v in value) + "]"
    return repr(value)


def _tensor_bytes(tensor: Any) -> memoryview:
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def program_digest(program: Any) -> str:
    """sha256 of an ExportedProgram's content: the code of every graph module, each node's
    value, the graph signature, the module call signature, the range constraints and every
    state_dict and constant tensor (name, dtype, shape and bytes)."""
    import torch

    from compiler.ir.mapped import ReleaseEvery

    digest = hashlib.sha256()

    def put(text: str) -> None:
        digest.update(text.encode())
        digest.update(b"\0")

    for name, module in program.graph_module.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            put(name)
            put(module.code)
            for node in module.graph.nodes:
                put(f"{node.op}|{node.name}|{node.target}|{_value_text(node.meta.get('val'))}")
    put(str(program.graph_signature))
    put(repr([str(entry.signature) for entry in program.module_call_graph]))
    put(repr(sorted((str(k), str(v)) for k, v in program.range_constraints.items())))
    release = ReleaseEvery()  # the mapped weights hashed leave the resident set as it goes
    for kind, tensors in (("state", program.state_dict), ("constant", program.constants)):
        for name in sorted(tensors):
            value = tensors[name]
            put(f"{kind}|{name}")
            if isinstance(value, torch.Tensor):
                put(_value_text(value))
                digest.update(_tensor_bytes(value))
                release.count(value.numel() * value.element_size())
            else:
                raise ValueError(f"constant {name!r} is a {type(value).__name__}, which has no content hash")
    return digest.hexdigest()


def hash_key(data: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=repr).encode()).hexdigest()


@attrs.frozen
class Hit:
    """What a lookup found: the last stage with a usable entry, its artifact, and the
    report rows of every stage after capture up to it (marked cached)."""

    stage: str
    artifact: Any
    records: tuple  # of StageRecord


@attrs.frozen
class Skipped:
    """What stands in for a stage the cache lets the driver skip."""

    record: Any  # its StageRecord, marked cached
    artifact: Any = None  # for the last stage held: its output, which the next stage takes


class StageCache:
    """A folder of stage outputs by key. `read=False`: nothing is looked up (entries are
    still written); `write=False`: nothing is written."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, *, read: bool = True, write: bool = True) -> None:
        self.directory = os.fspath(directory)
        self.max_bytes = int(max_bytes)
        self.read, self.write = read, write
        self.weights = WeightStore(self.directory)

    @classmethod
    def for_run(cls, driving: DriverOptions) -> "StageCache | None":
        """The cache a run uses: only with `cache_dir`. A run that must see every stage
        (dump_dir, print_after_change) stores but does not load; a resumed run has no capture
        to key it. None while a fix is switched off: no key holds the switches."""
        if not driving.cache or not driving.cache_dir or driving.resume_from:
            return None
        from compiler.ir.fix_switches import switched_off

        if switched_off():
            logger.info("stage cache not used: fixes are switched off (%s)", ", ".join(switched_off()))
            return None
        return cls(
            os.path.expanduser(driving.cache_dir),
            driving.cache_max_mb * 2**20,
            read=not (driving.dump_dir or driving.print_after_change),
            write=driving.verify,  # only verified outputs are trusted by later runs
        )

    # --- keys ------------------------------------------------------------------

    def keys(self, captured: Any, stages: Sequence[str], config: CompileConfig) -> dict[str, str] | None:
        """The key of each of `stages` (those after capture, in order) for `captured`,
        capture's output; None (logged) when the run cannot be keyed."""
        data = config.to_json()
        if data.get("unrecorded"):
            logger.info(
                "stage cache not used: backend option(s) %s cannot be recorded", ", ".join(sorted(data["unrecorded"]))
            )
            return None
        try:
            content = program_digest(captured.program)
        except Exception as exc:
            logger.info("stage cache not used: the captured program has no content hash (%s: %s)", type(exc).__name__, exc)
            return None
        common = {
            "format": CACHE_FORMAT,
            "versions": dependency_versions(),
            "project": project_version(),
        }
        key = hash_key({**common, "stage": "capture", "content": content})
        keys: dict[str, str] = {}
        for stage in stages:
            key = hash_key({
                **common,
                "input": key,
                "stage": stage,
                "options": data["stages"].get(stage, {}),
                "backend": data["backend"],
                "backend_options": data["backend_options"],
            })
            keys[stage] = key
        return keys

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key + ENTRY_SUFFIX)

    # --- lookup ----------------------------------------------------------------

    def lookup(self, keys: Mapping[str, str]) -> Hit | None:
        """The last of `keys` (stage -> key, in pipeline order) whose entry loads."""
        if not self.read:
            return None
        order = list(keys)
        for index in reversed(range(len(order))):
            stage = order[index]
            path = self.path(keys[stage])
            if not os.path.exists(path):
                continue
            start = time.perf_counter()
            try:
                artifact, meta = self._load(path, stage, keys[stage])
            except _RowOnly:
                continue
            except Exception as exc:
                logger.warning(
                    "stage cache: ignoring the unreadable entry for %s (%s: %s); it is rebuilt",
                    stage, type(exc).__name__, exc,
                )
                remove(path)
                continue
            seconds = time.perf_counter() - start
            touch(path)
            records = [self._record(s, self._meta_or_none(keys[s], s)) for s in order[:index]]
            records.append(self._record(stage, meta, seconds))
            logger.info("stage cache: loaded %s's output in %.3f s, skipping %s", stage, seconds, ", ".join(order[: index + 1]))
            return Hit(stage, artifact, tuple(records))
        return None

    def _load(self, path: str, stage: str, key: str) -> tuple[Any, dict]:
        with zipfile.ZipFile(path) as archive:
            meta = read_meta(archive, stage, key)
            if meta["artifact"] is None:
                raise _RowOnly
            if meta["artifact"] == "ExecutorchProgram":
                from compiler.ir.artifacts import ExecutorchProgram
                from compiler.ir.placement import PlacementPlan

                fields = meta["program"]
                artifact = ExecutorchProgram(
                    read_program(archive, _PTE, meta, self.weights),
                    tuple(fields["operators"]),
                    tuple(fields["delegates"]),
                    PlacementPlan.from_json(fields["plan"]),
                    fields["kernel_calls"],
                    fields["delegate_calls"],
                    read_program(archive, _PTD, meta, self.weights),
                )
                return artifact, meta
        # Reading a member checks its CRC: a garbled weight is refused by the load.
        from compiler.driver.stage_files import load_stage_file

        stage_file = load_stage_file(path, self.weights)
        if type(stage_file.artifact).__name__ != meta["artifact"] or stage_file.stage != stage:
            raise ValueError(f"the entry holds {type(stage_file.artifact).__name__} of {stage_file.stage}")
        return stage_file.artifact, meta

    def _meta_or_none(self, key: str, stage: str) -> dict | None:
        path = self.path(key)
        try:
            with zipfile.ZipFile(path) as archive:
                meta = read_meta(archive, stage, key)
        except Exception as exc:
            if os.path.exists(path):
                logger.debug("stage cache: no report row for %s (%s)", stage, exc)
            return None
        touch(path)
        return meta

    @staticmethod
    def _record(stage: str, meta: dict | None, seconds: float = 0.0):
        from compiler.reporting.report import StageRecord

        if meta is None:
            return StageRecord(stage=stage, seconds=seconds, cached=True)
        row = meta["record"]
        return StageRecord(
            stage=stage,
            seconds=seconds,
            nodes_in=row.get("nodes_in"),
            nodes_out=row.get("nodes_out"),
            delegates=row.get("delegates"),
            cpu_ops=row.get("cpu_ops"),
            metrics=row.get("metrics", {}),
            notes=row.get("notes", ()),
            cached=True,
            saved_seconds=row.get("seconds", 0.0) + row.get("verify_seconds", 0.0),
        )

    # --- store -----------------------------------------------------------------

    def store(self, key: str, stage: str, artifact: Any, record: Any, config: CompileConfig, *, row_only: bool = False) -> bool:
        """Writes `artifact` under `key` (`row_only`: only its report row); False (logged)
        when it cannot be stored."""
        if not self.write or self._holds(key, stage, row_only):
            return False
        from compiler.ir.artifacts import ExecutorchProgram
        from compiler.driver.stage_files import can_save, save_stage_file

        if not (can_save(artifact) or isinstance(artifact, ExecutorchProgram)):
            return False
        held = artifact_bytes(artifact)
        if not row_only and held > self.max_bytes:
            logger.info(
                "stage cache: %s's output not stored: its %.2f GB of weights are over the cache's limit of %.2f GB "
                "(cache_max_mb, --cache-max-mb)", stage, held / 1e9, self.max_bytes / 1e9,
            )
            return False
        row = attrs.asdict(record)
        row.pop("messages", None)
        kind = None if row_only else type(artifact).__name__
        meta = {"format": CACHE_FORMAT, "key": key, "stage": stage, "artifact": kind, "record": row}

        def write(temp: str) -> None:
            if row_only:
                write_zip(temp, {META: json.dumps(meta, default=repr)})
            elif isinstance(artifact, ExecutorchProgram):
                meta["program"] = {
                    "operators": list(artifact.operators),
                    "delegates": list(artifact.delegates),
                    "plan": artifact.plan.to_json(),
                    "kernel_calls": artifact.kernel_calls,
                    "delegate_calls": artifact.delegate_calls,
                }
                write_zip(temp, program_members(meta, {_PTE: artifact.data, _PTD: artifact.weights}, self.weights))
            else:
                save_stage_file(temp, artifact, stage, config, extra={META: json.dumps(meta, default=repr)},
                                weights=self.weights)

        return self.write_entry(key, f"{stage}'s output", write)

    def write_entry(self, key: str, what: str, write: Callable[[str], None]) -> bool:
        """`write(path)` into a temporary file of the folder, renamed to `key`'s entry when it
        returns (so processes may share the folder); False (logged) when it fails."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX, suffix=ENTRY_SUFFIX, dir=self.directory)
            os.close(fd)
        except OSError as exc:
            logger.warning("stage cache: cannot write to %s: %s", self.directory, exc)
            return False
        start = time.perf_counter()
        try:
            write(temp)
            os.replace(temp, self.path(key))
        except Exception as exc:
            remove(temp)
            logger.warning("stage cache: could not store %s (%s: %s)", what, type(exc).__name__, exc)
            return False
        logger.debug("stage cache: stored %s in %.3f s", what, time.perf_counter() - start)
        self.evict()
        return True

    def _holds(self, key: str, stage: str, row_only: bool) -> bool:
        """Whether the entry of `key` is there already (with its artifact, unless `row_only`)."""
        if not os.path.exists(self.path(key)):
            return False
        if row_only:
            return True
        meta = self._meta_or_none(key, stage)
        return meta is not None and meta["artifact"] is not None  # a broken entry is replaced

    # --- eviction --------------------------------------------------------------

    def evict(self) -> None:
        """Removes the least recently used entries until the folder is under `max_bytes`
        (and temporary files a dead writer left)."""
        entries = []
        now = time.time()
        for folder in (self.directory, self.weights.directory):
            try:
                names = os.listdir(folder)
            except OSError:
                continue
            for name in names:
                path = os.path.join(folder, name)
                try:
                    info = os.stat(path)
                except OSError:
                    continue
                if name.startswith(_TEMP_PREFIX):
                    if now - info.st_mtime > _STALE_TEMP_SECONDS:
                        remove(path)
                elif name.endswith(ENTRY_SUFFIX) or folder == self.weights.directory:
                    entries.append((info.st_mtime, info.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            remove(path)
            total -= size
            logger.debug("stage cache: evicted %s", os.path.basename(path))


class CacheRun:
    """One compile's use of the cache: its keys, what it found, what it stores."""

    def __init__(self, cache: StageCache, keys: dict[str, str], config: CompileConfig) -> None:
        self.cache, self.keys, self.config = cache, keys, config
        self.hit = cache.lookup(keys)
        self._unstored = 0.0  # run time of the stages since the last output stored (or loaded)

    @classmethod
    def start(cls, cache: StageCache, captured: Any, stages: Sequence[str], config: CompileConfig) -> "CacheRun | None":
        keys = cache.keys(captured, stages, config)
        return cls(cache, keys, config) if keys is not None else None

    def skip(self, stage: str) -> Skipped | None:
        """The driver asks before each stage: what stands in for it when the cache holds its
        output or a later stage's (its cached report row, and the artifact of the last one
        held), or None to run it."""
        if self.hit is None:
            return None
        held = list(self.keys)[: len(self.hit.records)]
        if stage not in held:
            return None
        record = self.hit.records[held.index(stage)]
        return Skipped(record, self.hit.artifact if stage == self.hit.stage else None)

    def store(self, stage: str, artifact: Any, record: Any) -> None:
        if stage not in self.keys:
            return
        self._unstored += record.seconds + record.verify_seconds
        row_only = self._unstored < STORE_AFTER_SECONDS and stage != list(self.keys)[-1]
        self.cache.store(self.keys[stage], stage, artifact, record, self.config, row_only=row_only)
        if not row_only:
            self._unstored = 0.0


class _RowOnly(Exception):
    """The entry holds a stage's report row, not its output."""


def artifact_bytes(artifact: Any) -> int:
    """The bytes of the weights an artifact holds: a program's files, or the tensors, delegate
    payloads and named data of a program in a stage."""
    from compiler.ir.artifacts import ExecutorchProgram

    if isinstance(artifact, ExecutorchProgram):
        return len(artifact.data) + (len(artifact.weights) if artifact.weights is not None else 0)
    import torch
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    from compiler.process.memory import tensor_bytes

    program = artifact.program
    tensors = [t for t in (*program.state_dict.values(), *program.constants.values()) if isinstance(t, torch.Tensor)]
    total = tensor_bytes(tensors)[0]
    for module in program.graph_module.modules():
        if isinstance(module, LoweredBackendModule):
            named = module.named_data_store_output
            total += len(module.processed_bytes) + sum(len(b) for b in (named.buffers if named is not None else ()))
    return total


def write_zip(path: str, members: Mapping[str, str | bytes | ProgramData]) -> None:
    """A program's bytes held in a file are copied in from it, never read whole."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            if isinstance(data, ProgramData):
                with archive.open(name, "w", force_zip64=True) as member:
                    data.write_to(member)
            else:
                archive.writestr(name, data)


def program_members(meta: dict, programs: Mapping[str, ProgramData | None], weights: WeightStore) -> dict:
    """An entry's members for a `.pte` and its data file: a large one goes to the weight store and
    `meta["stored"]` names it; a small one is a member. `meta` is the JSON member."""
    members: dict = {}
    meta["stored"] = {}
    for name, data in programs.items():
        if data is None:
            continue
        if len(data) >= SPILL_PROGRAM_BYTES:
            meta["stored"][name] = [weights.put_bytes(data), len(data)]
        else:
            members[name] = data
    return {META: json.dumps(meta, default=repr), **members}


def read_program(archive: zipfile.ZipFile, name: str, meta: dict, weights: WeightStore) -> ProgramData | None:
    """A `.pte` or data file `program_members` stored: a stored one is its file in the store, mapped
    when it runs (never read here); a member is read, which checks its CRC."""
    stored = meta.get("stored", {})
    if name in stored:
        digest, size = stored[name]
        return ProgramData(path=weights.checked_path(digest, size), owned=False)
    return ProgramData(archive.read(name)) if name in archive.namelist() else None


def read_meta(archive: zipfile.ZipFile, stage: str, key: str) -> dict:
    """An entry's JSON member, refused unless it is of this format, key and stage."""
    meta = json.loads(archive.read(_member(archive, META)))
    _check_meta(meta, stage, key)
    return meta


def _member(archive: zipfile.ZipFile, name: str) -> str:
    for member in archive.namelist():
        if member == name or member.endswith("/" + name):
            return member
    raise KeyError(f"no {name} in the entry")


def _check_meta(meta: dict, stage: str, key: str) -> None:
    if meta.get("format") != CACHE_FORMAT or meta.get("key") != key or meta.get("stage") != stage:
        raise ValueError(
            f"entry of format {meta.get('format')!r} for stage {meta.get('stage')!r} (expected format {CACHE_FORMAT} for {stage})"
        )


def touch(path: str) -> None:
    try:
        os.utime(path)
    except OSError:
        pass


def remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
