"""Weights held in files the process maps, not in its own memory.

A real-size compile cannot hold its weights: an 8B checkpoint is 16 GB in bfloat16. So the
checkpoint's tensors are views of its safetensors files mapped read-only, and a stage that makes
large new weights (quantized codes, a cast) writes them to a file of their own and maps that back
(`spilled`). A mapped page the compile read stays in the resident set until the mapping lets it go:
`release_mapped_pages` drops every mapped page of the process (they are read again from the page
cache, or the file, when next used), which the driver does between stages and as the lowering and
the writing of the program go. Mappings are read-only: a write into a mapped weight faults at
once instead of being lost when its page is dropped.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import threading
import warnings
import weakref
from typing import Iterable, Iterator, Sequence

import torch

from compiler.ir.program_data import spill_directory

# Tensors of at least this many bytes are worth a file of their own when a stage makes them.
SPILL_TENSOR_BYTES = 1 << 20
# Work that reads weight after weight drops the mapped pages it read once per this many bytes.
RELEASE_EVERY_BYTES = 128 << 20
# Spilled tensors start at multiples of this (a cache line, and any dtype's alignment).
_ALIGN = 64

_maps: "weakref.WeakSet[mmap.mmap]" = weakref.WeakSet()
_ranges: dict[int, tuple[int, int]] = {}  # id(map) -> (first address, end)
_lock = threading.Lock()


def _forget(key: int) -> None:
    with _lock:
        _ranges.pop(key, None)


def mapped_file(path: str | os.PathLike) -> mmap.mmap:
    """The whole file mapped read-only, its pages released with the others'."""
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    start = _address(mapping)
    with _lock:
        _maps.add(mapping)
        _ranges[id(mapping)] = (start, start + len(mapping))
    weakref.finalize(mapping, _forget, id(mapping))
    return mapping


def _address(mapping: mmap.mmap) -> int:
    if not len(mapping):
        return 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()


def tensor_in(mapping: mmap.mmap, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The tensor of `dtype` and `shape` whose bytes start `offset` bytes into the mapping."""
    count = 1
    for size in shape:
        count *= size
    if count == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the mapping is read-only on purpose
        return torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset).view(tuple(shape))


def is_mapped(tensor: torch.Tensor) -> bool:
    """Whether the tensor's bytes lie in a file this process maps."""
    if tensor.device.type != "cpu" or type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        return False
    try:
        address = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    with _lock:
        return any(start <= address < end for start, end in _ranges.values())


def mapped_bytes() -> int:
    """The bytes of every file the process maps now."""
    with _lock:
        return sum(end - start for start, end in _ranges.values())


def release_mapped_pages() -> None:
    """Drop every mapped page from the resident set; the next read of a weight maps it again."""
    with _lock:
        maps = list(_maps)
    for mapping in maps:
        try:
            mapping.madvise(mmap.MADV_DONTNEED)
        except (ValueError, OSError):  # closed, or an OS without it
            pass


class ReleaseEvery:
    """Calls `release_mapped_pages` once every `interval` bytes counted: for loops that read
    weight after weight (lowering, writing the program)."""

    def __init__(self, interval: int | None = None) -> None:
        self.interval = RELEASE_EVERY_BYTES if interval is None else interval
        self._counted = 0

    def count(self, size: int) -> None:
        self._counted += size
        if self._counted >= self.interval:
            self._counted = 0
            release_mapped_pages()


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def spilled(tensors: Iterable[torch.Tensor], directory: str | None = None) -> list[torch.Tensor]:
    """The tensors written to one new file and mapped back: equal values, none of them held in
    the process's memory. The file is unlinked at once; the kernel frees it with its mapping."""
    tensors = list(tensors)
    handle, path = tempfile.mkstemp(prefix="staged-compiler-", suffix=".weights", dir=directory or spill_directory())
    offsets = []
    try:
        with os.fdopen(handle, "wb") as f:
            for tensor in tensors:
                position = f.tell()
                padding = -position % _ALIGN
                if padding:
                    f.write(b"\0" * padding)
                offsets.append(position + padding)
                f.write(_raw_bytes(tensor))
        mapping = mapped_file(path) if offsets and os.path.getsize(path) else None
    finally:
        os.remove(path)
    return [
        tensor_in(mapping, offset, t.dtype, t.shape) if mapping is not None else t.detach().clone()
        for t, offset in zip(tensors, offsets)
    ]


@contextlib.contextmanager
def pages_released_as_it_runs(module: torch.nn.Module, interval: int | None = None) -> Iterator[None]:
    """While the block runs `module`, its mapped weights' pages are dropped as the run goes (every
    `interval` bytes of the weights of the layers run, `RELEASE_EVERY_BYTES` by default): an eager run of a mapped model does not
    read every weight into the resident set. Nothing is hooked for a model held in memory."""
    modules = module.modules() if isinstance(module, torch.nn.Module) else ()
    leaves = [m for m in modules if any(is_mapped(p) for p in m.parameters(recurse=False))]
    if not leaves:
        yield
        return
    release = ReleaseEvery(interval)

    def counted(layer: torch.nn.Module, args: tuple) -> None:  # before it runs: a large layer reads alone
        release.count(sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False)))

    hooks = [m.register_forward_pre_hook(counted) for m in leaves]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        release_mapped_pages()


class RowsFile:
    """Tensors written into one new file a block of rows at a time, then mapped: a tensor made
    row block by row block (a large weight quantized in pieces) is never whole in memory.
    `layout` names each tensor's dtype and whole shape."""

    def __init__(self, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], directory: str | None = None) -> None:
        self.layout = layout
        self.offsets: dict[str, int] = {}
        self.row_bytes: dict[str, int] = {}
        end = 0
        for name, (dtype, shape) in layout.items():
            end += -end % _ALIGN
            self.offsets[name] = end
            per_row = dtype.itemsize
            for size in shape[1:]:
                per_row *= size
            self.row_bytes[name] = per_row
            end += per_row * shape[0]
        handle, self.path = tempfile.mkstemp(prefix="staged-compiler-", suffix=".weights", dir=directory or spill_directory())
        self._file = os.fdopen(handle, "r+b")
        self._file.truncate(end)

    def write(self, name: str, first_row: int, rows: torch.Tensor) -> None:
        dtype, shape = self.layout[name]
        if rows.dtype != dtype or tuple(rows.shape[1:]) != tuple(shape[1:]) or first_row + rows.shape[0] > shape[0]:
            raise ValueError(f"rows {first_row}.. of {name} ({rows.dtype}, {list(rows.shape)}) do not fit {dtype}, {list(shape)}")
        self._file.seek(self.offsets[name] + first_row * self.row_bytes[name])
        self._file.write(_raw_bytes(rows))

    def mapped(self) -> dict[str, torch.Tensor]:
        """The tensors, mapped from the file (which is unlinked: it goes with its mapping)."""
        self._file.close()
        try:
            mapping = mapped_file(self.path) if os.path.getsize(self.path) else None
        finally:
            os.remove(self.path)
        return {
            name: tensor_in(mapping, self.offsets[name], dtype, shape) if mapping is not None else torch.empty(shape, dtype=dtype)
            for name, (dtype, shape) in self.layout.items()
        }

    def discard(self) -> None:
        self._file.close()
        try:
            os.remove(self.path)
        except OSError:
            pass


def cast_into_file(tensor: torch.Tensor, dtype: torch.dtype, block_bytes: int = 32 << 20) -> torch.Tensor:
    """`tensor.to(dtype)` written into a mapped file a block of rows at a time: a mapped weight
    widened (bfloat16 to float32) is never whole in memory, in either dtype."""
    tensor = tensor.detach()
    if tensor.dim() == 0 or tensor.numel() * dtype.itemsize < SPILL_TENSOR_BYTES:
        return tensor.to(dtype)
    row_bytes = max(1, tensor[0].numel() * dtype.itemsize)
    block = max(1, block_bytes // row_bytes)
    out = RowsFile({"value": (dtype, tuple(tensor.shape))})
    try:
        for start in range(0, tensor.shape[0], block):
            out.write("value", start, tensor[start : start + block].to(dtype))
            release_mapped_pages()
    except BaseException:
        out.discard()
        raise
    return out.mapped()["value"]
