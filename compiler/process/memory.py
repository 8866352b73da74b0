"""The process's resident memory: what a stage holds and the peak it reached, and what the machine
has left.

Linux gives both the current resident set and its high-water mark (`/proc/self/status`); the
high-water mark is never reset here, because a benchmark reading it (or its parent reading
`RUSAGE_CHILDREN`) must see the whole process's peak. A stage's own peak is that mark when the
stage raised it, else the highest of samples taken while the stage ran. Elsewhere only the
process's peak is known (`getrusage`) and the rest reads None.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import threading
from typing import Iterable, Iterator

from compiler.ir.errors import InsufficientMemory

_STATUS = "/proc/self/status"
_MEMINFO = "/proc/meminfo"
# How often the sampler reads the resident set while a stage runs: a stage that raises the process's
# high-water mark gets that mark exactly; a lower peak is sampled (a gigabyte takes longer than this to fill).
SAMPLE_SECONDS = 0.05

GB = 1e9


def _status_bytes(field: str) -> int | None:
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes() -> int | None:
    """The process's resident set now (None where the OS does not say)."""
    return _status_bytes("VmRSS:")


def anonymous_bytes() -> int | None:
    """The process's own memory now, its resident set less the pages of files it maps (the
    mapped weights of a checkpoint, which the kernel can drop at any time)."""
    return _status_bytes("RssAnon:")


def peak_resident_bytes() -> int:
    """The process's resident high-water mark since it started."""
    peak = _status_bytes("VmHWM:")
    if peak is not None:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB elsewhere


def available_bytes() -> int | None:
    """Memory the machine can still give without swapping (`MemAvailable`), None where unknown."""
    try:
        with open(_MEMINFO) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gigabytes(n: int | None) -> str:
    return "-" if n is None else f"{n / GB:.2f} GB"


class PeakSampler:
    """The peak resident set while a piece of work runs: the high-water mark when the work raised
    it, else the highest sample taken by a background thread."""

    def __init__(self, interval: float = SAMPLE_SECONDS) -> None:
        self.interval = interval
        self.peak: int | None = None
        self.anonymous_peak: int | None = None  # sampled only: the kernel keeps no mark of it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mark_before = 0

    def start(self) -> None:
        self._mark_before = peak_resident_bytes()
        self.peak = resident_bytes()
        self.anonymous_peak = anonymous_bytes()
        if self.peak is None:
            return  # nothing to sample here
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="peak-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            now = resident_bytes() or 0
            if now > (self.peak or 0):
                self.peak = now
            anonymous = anonymous_bytes() or 0
            if anonymous > (self.anonymous_peak or 0):
                self.anonymous_peak = anonymous

    def stop(self) -> int | None:
        """The peak since `start` (None where the OS gives no resident set)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        now = resident_bytes()
        if now is None:
            return None
        self.anonymous_peak = max(self.anonymous_peak or 0, anonymous_bytes() or 0) or None
        mark = peak_resident_bytes()
        sampled = max(self.peak or 0, now)
        return mark if mark > self._mark_before else sampled


@contextlib.contextmanager
def peak_of() -> Iterator[PeakSampler]:
    """`with peak_of() as sampler: ...`, then `sampler.peak` is the peak of the block."""
    sampler = PeakSampler()
    sampler.start()
    try:
        yield sampler
    finally:
        sampler.peak = sampler.stop()


# Allocations of at least this many bytes are mapped on their own and go back to the system when
# freed (glibc's `M_MMAP_THRESHOLD`).
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_threshold_set = False


# A compile of a model with at least this many bytes of weights makes large freed blocks go back to
# the system; a small one keeps glibc's default (reusing freed blocks saves a small compile's page faults).
RETURNED_FROM_BYTES = 64 << 20


def freed_tensors_returned(weight_bytes: int) -> None:
    """Make large freed blocks go back to the system for the rest of the process (glibc only), once
    a compile of `weight_bytes` of weights starts (at least `RETURNED_FROM_BYTES`).

    glibc raises its threshold for mapping a block on its own each time a mapped block is freed,
    up to 32 MB; after that, tensors of a weight's size come from its heap, whose freed space it
    keeps. Quantizing a layer makes and frees float temporaries of the weight's size: the process
    kept 1.2x the weights of such garbage (a 100 MB stack quantized 8da4w: 150 MB held, 28 MB of it
    the quantized weights). A fixed threshold keeps every large block mapped on its own."""
    global _threshold_set
    if _threshold_set or weight_bytes < RETURNED_FROM_BYTES or not sys.platform.startswith("linux"):
        return
    _threshold_set = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):  # not glibc (musl has no mallopt to speak of)
        pass


def tensor_bytes(tensors: Iterable) -> tuple[int, int]:
    """(all bytes, the half-precision ones') of distinct tensors (a tied weight counted once)."""
    import torch

    seen: set[int] = set()
    total = half = 0
    for tensor in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        size = tensor.numel() * tensor.element_size()
        total += size
        if tensor.dtype in (torch.bfloat16, torch.float16):
            half += size
    return total, half


# What a weight a scheme quantizes holds while the program is made, per element: its code (a
# byte; TorchAO keeps 4-bit codes in int8), the payload's packed copy and the program's, with a
# margin. Measured with Core ML's 4w on Llama-shaped checkpoints (tied embeddings, so the embedding
# is also held in float): 5.4 GB of anonymous memory added at 1B (estimated 6.9 GB), 11.0 GB at 3B
# (estimated 14.4 GB).
QUANTIZED_BYTES_PER_WEIGHT = 3


# What the Core ML check's float32 re-check holds besides its conversion, per byte of the program
# state converted again: the float32 program's stages and its reference run. Measured: a 1B
# Llama's 4w re-check added 8.0 GB of anonymous memory for 2.2 GB of state.
RECHECK_RUN_PER_STATE_BYTE = 2.0


# What a compile of weights mapped from a checkpoint holds at once besides the libraries: a chunk of
# layers quantized, a block of rows widened, a partition lowered (measured: 0.8 GB over the libraries
# at 1B on XNNPACK 8da4w).
STREAMED_BYTES = 2 << 30


def compile_bytes(total: int, half: int, widens_half: bool, lowering: float, quantized: tuple[int, int, int] = (0, 0, 0)) -> int:
    """What compiling a model of `total` bytes of weights (`half` of them half-precision, as
    `tensor_bytes` counts them) may add to the process: its half-precision weights stored again in
    float32 for a backend that computes in it (`widens_half`: twice their bytes), and what the
    backend's lowering holds, `lowering` times the weights in float32. The weights a quantize
    scheme turns into codes, `quantized` = (their bytes, the half-precision ones', their
    elements), count `QUANTIZED_BYTES_PER_WEIGHT` each instead: they are never widened, and
    the conversion holds their codes, not their float forms."""
    coded, coded_half, elements = quantized
    total, half = total - coded, half - coded_half
    float32 = total + half
    return int((2 * half if widens_half else 0) + lowering * float32 + QUANTIZED_BYTES_PER_WEIGHT * elements)


def refuse_unless_it_fits(needed: int, doing: str, stage: str | None = None, hint: str = "") -> None:
    """A named error, before the work starts, when the machine has less memory available than
    `needed` (nothing is refused where the OS does not say what it has)."""
    available = available_bytes()
    if available is None or needed <= available:
        return
    raise InsufficientMemory(
        f"{doing} needs about {gigabytes(needed)} more memory; this machine has {gigabytes(available)} available",
        stage=stage,
        hint=(hint + "; " if hint else "") + "close other programs, or compile on a machine with more memory "
        "(the driver option memory_check turned off tries anyway)",
    )
