"""The steps of long work deep inside a dependency, for whoever listens.

Work like coremltools converting ops or running its MIL pass pipelines reports its
steps through `steps()`; the CLI's live display (`compiler.cli.live_progress`)
listens and shows the latest on the running stage's line, so a long Core ML
lowering is not a silent minute. Without a listener (library use) the steps go
nowhere.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, Iterable, Iterator

StepListener = Callable[[str, int, "int | None"], None]

_listener: contextvars.ContextVar[StepListener | None] = contextvars.ContextVar("progress_listener", default=None)


def steps(iterable: Iterable[Any], desc: str = "", total: int | None = None, **_ignored: Any) -> Iterator[Any]:
    """Iterates `iterable`, telling the listener how far it got; takes tqdm's arguments, so it
    can stand in for a dependency's progress bar."""
    listener = _listener.get()
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    done = 0
    for item in iterable:
        if listener:
            listener(desc, done, total)
        yield item
        done += 1
    if listener:
        listener(desc, done, total)


def listen(listener: StepListener) -> contextvars.Token:
    """Send the steps reported in this context to `listener`, until `stop_listening(token)`."""
    return _listener.set(listener)


def stop_listening(token: contextvars.Token) -> None:
    _listener.reset(token)


def report(desc: str, done: int, total: int | None = None) -> None:
    """Tell the listener how far work that is not a loop over an iterable got."""
    listener = _listener.get()
    if listener:
        listener(desc, done, total)


class WeightsWritten:
    """Counts the weights a stage writes out as it makes them (the blobs of a lowering, the
    constants of the program): the running stage's line says how many MB of about `total` bytes
    are written, and the mapped weights they were made of leave the resident set as it goes."""

    def __init__(self, total: int | None = None) -> None:
        from compiler.ir.mapped import ReleaseEvery

        self.total = total
        self.done = 0
        self._release = ReleaseEvery()

    def __call__(self, size: int) -> None:
        self.done += size
        self._release.count(size)
        report("MB of weights written", self.done >> 20, (self.total >> 20) if self.total else None)
