"""Test-only switches that turn one of our fixes off, to prove the check and `locate` catch the bug it fixes.

Every backend (and the CPU's kernel handling) works around things stock ExecuTorch, coremltools
or a runtime kernel get silently wrong. Each owner declares its fixes once, as a dict of name ->
what goes wrong without it, and gets a `Switches` object:

    SWITCHES = fix_switches.register("mlx", FIXES)
    ...
    if not SWITCHES.on("clamp_input_cast"):   # at the one place the fix acts
        return 0

and tests turn a fix off with `SWITCHES.off("clamp_input_cast")` (or `fixes_off("mlx", ...)`),
compile, and show that comparing the program with eager fails; nothing else turns a fix off.

A fix asks `on(name)` where it acts, when a node is rewritten, converted or a rule is asked,
never when a registry or table is built, so switching cannot disturb what is cached. The
switches are process-wide, not per thread (a compile may convert in another thread than the one
that switched), and counted, so nested or concurrent blocks compose: a fix is off while any
block that turned it off is open.

This module sits in `compiler.ir`, the lowest layer, so the CPU kernel checks there can ask it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Iterator, Mapping

_LOCK = threading.Lock()
_off: collections.Counter[tuple[str, str]] = collections.Counter()  # (owner, name) -> open blocks that turned it off
_REGISTRY: dict[str, "Switches"] = {}


class Switches:
    """One owner's fixes (name -> what goes wrong without it) and their switches."""

    def __init__(self, owner: str, fixes: Mapping[str, str]) -> None:
        self.owner = owner
        self.fixes = fixes

    def _known(self, names: tuple[str, ...]) -> None:
        unknown = sorted(set(names) - set(self.fixes))
        if unknown:
            raise ValueError(
                f"unknown {self.owner} fix {', '.join(map(repr, unknown))}; "
                f"the fixes are: {', '.join(self.fixes)}"
            )

    def on(self, name: str) -> bool:
        """Whether fix `name` applies now (always, unless a test turned it off)."""
        self._known((name,))
        return _off[self.owner, name] == 0

    @contextlib.contextmanager
    def off(self, *names: str) -> Iterator[None]:
        """For tests: compile with these fixes off, as stock would."""
        self._known(names)
        keys = [(self.owner, name) for name in names]
        with _LOCK:
            _off.update(keys)
        try:
            yield
        finally:
            with _LOCK:
                _off.subtract(keys)


def register(owner: str, fixes: Mapping[str, str]) -> Switches:
    """The switches of `owner`'s fixes; an owner registers once (again with the same dict: the same object)."""
    with _LOCK:
        known = _REGISTRY.get(owner)
        if known is not None:
            if dict(known.fixes) != dict(fixes):
                raise ValueError(f"fix owner {owner!r} is registered with other fixes")
            return known
        _REGISTRY[owner] = Switches(owner, fixes)
        return _REGISTRY[owner]


def switches(owner: str) -> Switches:
    """A registered owner's switches (its module must have been imported)."""
    try:
        return _REGISTRY[owner]
    except KeyError:
        raise ValueError(f"no fixes registered for {owner!r}; registered: {', '.join(_REGISTRY)}") from None


def fixes_off(owner: str, *names: str):
    """For tests: `owner`'s fixes `names` off while inside."""
    return switches(owner).off(*names)


def registered() -> dict[str, Mapping[str, str]]:
    """Owner -> its fixes, for every owner imported so far."""
    return {owner: s.fixes for owner, s in _REGISTRY.items()}


def switched_off() -> list[str]:
    """The fixes off now, as "owner.name" (the stage cache neither reads nor stores while any is:
    its key does not hold them, and a payload made without a fix must not be given to a run with it)."""
    with _LOCK:
        return sorted(f"{owner}.{name}" for (owner, name), count in _off.items() if count > 0)
