"""One data file for several programs: weights compiled from one checkpoint, each stored once.

Programs compiled with `external_weights` each write a `.ptd`. Programs made from one checkpoint (a
float and a quantized variant, two backends, a model and its methods compiled apart) hold many of
the same weights: the token embedding the CPU reads, the float weight XNNPACK's payload names and
the CPU's copy of it. `share_weights` writes one data file holding every entry of the given files,
each distinct content once (entries of equal bytes point at one segment, as ExecuTorch's format
allows), and each program loads with it (`compiler.run(..., weights=)`, `python -m compiler run
--weights`). The runtime finds an entry by its key; two files holding different bytes under one key
(two models' weights of one name) cannot share a file, and that is a named error. Segments are
copied a piece at a time: the weights are never all in memory.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Sequence

import attrs

from compiler.ir.errors import UserInputError
from compiler.ir.private_api import data_file_index, file_blob, write_data_file
from compiler.ir.program_data import data_file_path, spill_directory

_CHUNK = 8 << 20


@attrs.frozen
class SharedWeights:
    """What `share_weights` wrote."""

    path: str
    files: tuple[str, ...]  # the data files it read
    entries: int  # distinct keys
    segments: int  # distinct contents stored
    bytes_read: int  # the inputs' segments' bytes
    bytes_written: int  # the shared file's size

    def describe(self) -> str:
        return (
            f"wrote {self.path}: {self.entries} entries of {len(self.files)} data files in {self.segments} "
            f"segments, {_size(self.bytes_written)} for the files' {_size(self.bytes_read)}"
        )


def _size(count: int) -> str:
    return f"{count / 1e6:.1f} MB" if count >= 1e6 else f"{count / 1e3:.1f} KB"


def _data_file(path: str | os.PathLike) -> str:
    """A `.ptd`, or the one beside a `.pte`."""
    path = os.fspath(path)
    data = data_file_path(path) if path.endswith(".pte") else path
    if not os.path.isfile(data):
        raise UserInputError(
            f"no data file at {data!r}" + (f" (beside the program {path!r})" if data != path else ""),
            hint="compile the program with --external-weights (external_weights=True), which writes its weights "
            "to a .ptd beside it",
        )
    return data


def _copied(source, offset: int, size: int) -> tuple[str, str]:
    """The segment copied to a file of its own, and its sha256."""
    digest = hashlib.sha256()
    handle, path = tempfile.mkstemp(prefix="staged-compiler-", suffix=".segment", dir=spill_directory())
    try:
        with os.fdopen(handle, "wb") as out:
            source.seek(offset)
            left = size
            while left:
                piece = source.read(min(_CHUNK, left))
                if not piece:
                    raise UserInputError(f"the data file {source.name!r} is shorter than its index says",
                                         hint="compile the program again")
                digest.update(piece)
                out.write(piece)
                left -= len(piece)
    except BaseException:
        os.remove(path)
        raise
    return path, digest.hexdigest()


def share_weights(data_files: Sequence[str | os.PathLike], output: str | os.PathLike) -> SharedWeights:
    """One data file at `output` holding every entry of `data_files` (`.ptd` files, or `.pte` files
    whose `.ptd` is beside them), each distinct content once."""
    files = [_data_file(path) for path in data_files]
    if not files:
        raise UserInputError("no data files to share", hint="give the .ptd (or .pte) files of the programs")
    buffers: list = []
    by_digest: dict[str, int] = {}
    keys: dict[str, tuple[str, str, object]] = {}  # key -> (digest, file, layout)
    named: list[tuple[str, int, object]] = []
    read = 0
    for path in files:
        try:
            base, segments, entries = data_file_index(path)
        except ValueError as exc:
            raise UserInputError(str(exc), hint="give data files ExecuTorch wrote (.ptd)") from exc
        digests = []
        with open(path, "rb") as source:
            for offset, size in segments:
                copy, digest = _copied(source, base + offset, size)
                if digest in by_digest:
                    os.remove(copy)
                else:
                    by_digest[digest] = len(buffers)
                    buffers.append(file_blob(copy, owned=True))
                digests.append(digest)
                read += size
        for key, segment, layout in entries:
            digest = digests[segment]
            if key in keys:
                if keys[key][0] != digest:
                    raise UserInputError(
                        f"the data files {keys[key][1]!r} and {path!r} hold different weights under one name, "
                        f"{key!r}: one data file cannot serve both programs",
                        hint="share a data file only between programs compiled from the same weights",
                    )
                continue
            keys[key] = (digest, path, layout)
            named.append((key, by_digest[digest], layout))
    output = os.fspath(output)
    temp = output + ".tmp"
    try:
        with open(temp, "wb") as f:
            write_data_file(f, buffers, named)
        os.replace(temp, output)
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    return SharedWeights(output, tuple(files), len(named), len(buffers), read, os.path.getsize(output))
