"""A program's bytes, held in memory or in a file of their own.

A real-size program is gigabytes of weights. Emit writes such a program to a file as it is
serialised instead of joining it into one `bytes` (which would hold the weights a second time);
saving it links or copies that file, and the runtime maps it. A small program stays in memory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import Any

from compiler.ir.private_api import pte_program_bytes, pte_program_only, pte_segment_base

# Blobs (a weight in a payload's named data, a CPU constant) of at least this many bytes are
# written to a file as they are made; programs of at least `SPILL_PROGRAM_BYTES` are held in one.
SPILL_BLOB_BYTES = 256 << 10
SPILL_PROGRAM_BYTES = 8 << 20

# Where those files go (and the files of weights a stage writes, `compiler.ir.mapped`): this
# variable's folder, else the system's temporary folder.
SPILL_DIR_VARIABLE = "STAGED_COMPILER_SPILL_DIR"


def spill_directory() -> str:
    folder = os.environ.get(SPILL_DIR_VARIABLE) or tempfile.gettempdir()
    os.makedirs(folder, exist_ok=True)
    return folder


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


class ProgramData:
    """A `.pte`'s bytes: `bytes` in memory, or a file this object owns (removed when it goes)."""

    def __init__(self, data: bytes | None = None, *, path: str | None = None, owned: bool = True) -> None:
        """`owned`: the file is this object's, removed when it goes (not a file a user gave)."""
        if (data is None) == (path is None):
            raise ValueError("give the bytes or the path of a file holding them")
        self._data = data
        self._path = path
        self._owned = owned
        self._size = len(data) if data is not None else os.path.getsize(path)
        if path is not None and owned:
            weakref.finalize(self, _remove, path)

    @classmethod
    def written(cls, write, directory: str | None = None) -> "ProgramData":
        """A program `write(file)` writes into a new file of its own."""
        handle, path = tempfile.mkstemp(prefix="staged-compiler-", suffix=".pte", dir=directory or spill_directory())
        try:
            with os.fdopen(handle, "wb") as f:
                write(f)
        except BaseException:
            _remove(path)
            raise
        return cls(path=path)

    def small_in_memory(self) -> "ProgramData":
        """These bytes read into memory when fewer than `SPILL_PROGRAM_BYTES` (their file goes), else self."""
        return ProgramData(self.read()) if self._path is not None and self._size < SPILL_PROGRAM_BYTES else self

    @property
    def path(self) -> str | None:
        """The file holding the bytes, None for bytes in memory."""
        return self._path

    def __len__(self) -> int:
        return self._size

    def read(self) -> bytes:
        if self._data is not None:
            return self._data
        with open(self._path, "rb") as f:
            return f.read()

    def head(self, size: int) -> bytes:
        """The first `size` bytes (a program's header and flatbuffer), without reading the rest."""
        if self._data is not None:
            return self._data[:size]
        with open(self._path, "rb") as f:
            return f.read(size)

    def write_to(self, file) -> None:
        """Copy the bytes into an open binary file, a piece at a time."""
        if self._data is not None:
            file.write(self._data)
            return
        with open(self._path, "rb") as f:
            shutil.copyfileobj(f, file, 8 << 20)

    def save(self, path: str | os.PathLike) -> None:
        """Write the bytes to `path`: an owned file's are linked there where the file system allows,
        else copied by the kernel; neither reads them into this process. A file this object does not
        own (a user's, the stage cache's) is copied: writing the saved file must not change it."""
        path = os.fspath(path)
        if self._data is not None:
            with open(path, "wb") as f:
                f.write(self._data)
            return
        _remove(path)
        try:
            if not self._owned:
                raise OSError("not ours to link")
            os.link(self._path, path)
        except OSError:
            shutil.copyfile(self._path, path)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProgramData):
            return NotImplemented
        return len(self) == len(other) and self.read() == other.read()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        where = f" in {self._path}" if self._path else ""
        return f"<{self._size} bytes{where}>"


def data_file_path(program_path: str | os.PathLike) -> str:
    """Where a program's data file goes: beside it, `model.pte` -> `model.ptd`."""
    return os.path.splitext(os.fspath(program_path))[0] + ".ptd"


def save_program(path: str | os.PathLike, data: ProgramData, weights: ProgramData | None) -> tuple[str, ...]:
    """Write a `.pte` to `path` and its data file, if it has one, beside it; the paths written."""
    path = os.fspath(path)
    data.save(path)
    if weights is None:
        return (path,)
    weights_path = data_file_path(path)
    weights.save(weights_path)
    return path, weights_path


def program_data(value: "bytes | ProgramData") -> ProgramData:
    """`ProgramData` of bytes (what callers that hold a whole `.pte` give)."""
    return value if isinstance(value, ProgramData) else ProgramData(bytes(value))


# Enough of a `.pte`'s first bytes to hold its extended header.
_HEADER_BYTES = 64


def delegate_payload(data: ProgramData, flatbuffer: Any, delegate: Any) -> bytes:
    """A delegate's payload (`BackendDelegate` of one of the program's plans), read alone: from
    the flatbuffer when it is inline, else its segment only."""
    from executorch.exir.schema import DataLocation

    reference = delegate.processed
    if reference.location == DataLocation.INLINE:
        return bytes(flatbuffer.backend_delegate_data[reference.index].data)
    segment = flatbuffer.segments[reference.index]
    start = pte_segment_base(data.head(_HEADER_BYTES)) + segment.offset
    if data.path is None:
        return data.read()[start : start + segment.size]
    with open(data.path, "rb") as f:
        f.seek(start)
        return f.read(segment.size)


def flatbuffer_program(data: ProgramData) -> Any:
    """The program's flatbuffer (execution plans, operators, delegate ids) without its segments:
    what it calls is read without reading its weights."""
    size = pte_program_bytes(data.head(_HEADER_BYTES))
    return pte_program_only(data.head(size) if size is not None else data.read())


# The constant method in which a quantized program records the configuration it was compiled
# with (JSON): checking the program later (`run`) quantizes the model again by it.
CONFIG_METHOD = "staged_compiler_config"


def recorded_config(flatbuffer: Any) -> dict | None:
    """The configuration a program records (`CONFIG_METHOD`), as JSON data; None when it records
    none (a program that did not quantize, or one built elsewhere)."""
    import json

    for plan in flatbuffer.execution_plan:
        if plan.name == CONFIG_METHOD and len(plan.outputs) == 1:
            return json.loads(plan.values[plan.outputs[0]].val.string_val)
    return None
