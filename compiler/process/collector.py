"""Python's garbage collector during a compile: it scans only what the compile made.

A process that imported torch, ExecuTorch and coremltools holds over half a million
objects, and every full collection walks all of them (about 0.3 s here), whether the
collector's own schedule or a stage asks for it. Those objects are moved out of its
view (`gc.freeze`) for the length of a compile and put back after; a process that froze
its own objects keeps its freeze untouched.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from typing import Iterator

_LOCK = threading.Lock()
_compiles = 0  # compiles running in this process (threads, or a compile inside a stage)
_froze = False  # whether the first of them froze the collector's view


@contextlib.contextmanager
def scans_only_new_objects() -> Iterator[None]:
    global _compiles, _froze
    with _LOCK:
        if _compiles == 0 and gc.get_freeze_count() == 0:
            gc.freeze()
            _froze = True
        _compiles += 1
    try:
        yield
    finally:
        with _LOCK:
            _compiles -= 1
            if _compiles == 0 and _froze:
                gc.unfreeze()
                _froze = False


def collect() -> float:
    """A full collection now; the seconds it took."""
    start = time.perf_counter()
    gc.collect()
    return time.perf_counter() - start
