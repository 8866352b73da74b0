"""Weights stored once, by their content: the stage cache's entries name them instead of holding them.

A stage file holds its program's weights, so a cache that stores several stages of one compile held
its weights once per stage (a depth-48 stack's entries: 515 MB), and a 3B model would write 12 GB per
stage. Here each large weight (a program's tensor, a delegate's payload or named data, a program
file) is written once to `<cache>/weights/<sha256>`, the same bytes once across stages and runs.
Files are written to a temporary name and renamed into place (processes share the folder) and never
change after; a load maps a weight copy-on-write instead of reading it, so a warm run holds only the
pages it touches. A file of the wrong size is refused, and the entry naming it rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    import torch

# torch is imported where a tensor is handled: a program cache hit uses this store without it.
FOLDER = "weights"
# Weights smaller than this stay inside their entry: a file each would cost more than it saves.
MIN_BYTES = 256 << 10
_TEMP_PREFIX = ".tmp-"


class MissingWeight(FileNotFoundError):
    """An entry names a weight the store no longer holds (evicted, or removed by hand)."""


def storable(tensor: Any) -> bool:
    """A plain tensor whose bytes are exactly its storage, large enough to be stored on its own."""
    from compiler.ir.invariants import plain_tensor

    return (
        plain_tensor(tensor)
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        and tensor.numel() * tensor.element_size() >= MIN_BYTES
    )


def _tensor_view(tensor: "torch.Tensor") -> memoryview:
    import torch

    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


class WeightStore:
    def __init__(self, cache_directory: str | os.PathLike) -> None:
        self.directory = os.path.join(os.fspath(cache_directory), FOLDER)
        self._release = None

    def path(self, digest: str) -> str:
        return os.path.join(self.directory, digest)

    # --- writing -----------------------------------------------------------------

    def _put(self, write_and_hash) -> str:
        """`write_and_hash(file, digest)` writes the bytes and feeds them to the digest; the
        bytes go in place under their digest unless the store holds them already."""
        os.makedirs(self.directory, exist_ok=True)
        handle, temp = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=self.directory)
        try:
            digest = hashlib.sha256()
            with os.fdopen(handle, "wb") as file:
                write_and_hash(file, digest)
            name = digest.hexdigest()
            target = self.path(name)
            if os.path.exists(target):
                os.utime(target)  # used again: the most recently used
                os.remove(temp)
            else:
                os.chmod(temp, 0o444)
                os.replace(temp, target)
            return name
        except BaseException:
            if os.path.exists(temp):
                os.remove(temp)
            raise

    def put_bytes(self, data: Any) -> str:
        """Bytes, a buffer, or a blob held in a file (`write_to_file`, ExecuTorch's `FileBackedData`;
        `write_to`, a `ProgramData`), copied in a piece at a time; its digest."""

        def write(file: BinaryIO, digest: Any) -> None:
            hashing = _Hashing(file, digest)
            if hasattr(data, "write_to"):
                data.write_to(hashing)
            elif hasattr(data, "write_to_file"):
                data.write_to_file(hashing)
            else:
                hashing.write(data)

        return self._put(write)

    def put_tensor(self, tensor: "torch.Tensor") -> dict:
        """A `storable` tensor's bytes stored; the reference `tensor` takes to map it back."""
        import torch

        from compiler.ir.mapped import ReleaseEvery

        name = self.put_bytes(_tensor_view(tensor))
        self._release = self._release or ReleaseEvery()
        self._release.count(tensor.numel() * tensor.element_size())  # a mapped weight's pages, read to store it
        return {
            "digest": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "parameter": isinstance(tensor, torch.nn.Parameter), "requires_grad": tensor.requires_grad,
        }

    # --- reading -----------------------------------------------------------------

    def checked_path(self, digest: str, size: int | None = None) -> str:
        """The file of `digest`, refused when it is missing or of another size than recorded."""
        path = self.path(digest)
        try:
            found = os.path.getsize(path)
        except OSError as exc:
            raise MissingWeight(f"the stage cache holds no weight {digest[:16]}") from exc
        if size is not None and found != size:
            raise ValueError(f"the stage cache's weight {digest[:16]} holds {found} bytes, not {size}")
        os.utime(path)
        return path

    def tensor(self, reference: dict) -> "torch.Tensor":
        """The tensor of a `put_tensor` reference, its file mapped copy-on-write (not read)."""
        import torch

        dtype = getattr(torch, reference["dtype"])
        shape = reference["shape"]
        size = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        path = self.checked_path(reference["digest"], size)
        flat = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
        tensor = flat.view(dtype).reshape(shape)
        if reference["parameter"]:
            return torch.nn.Parameter(tensor, requires_grad=reference["requires_grad"])
        return tensor.requires_grad_(reference["requires_grad"]) if tensor.is_floating_point() else tensor


class _Hashing:
    """A binary file that feeds what it is given to a digest on its way."""

    def __init__(self, file: BinaryIO, digest: Any) -> None:
        self.file, self.digest = file, digest

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self.file.write(data)
