"""One entry per backend (compiler.ir.targets): what it says agrees with the backend package."""

import pytest

from compiler import backends
from compiler.ir.errors import UserInputError
from compiler.ir.placement import backend_name
from compiler.ir.targets import BY_DELEGATE_ID, TARGETS


def test_the_backends_offered_are_the_entries():
    assert backends.available() == tuple(t.name for t in TARGETS)
    with pytest.raises(UserInputError, match="unknown backend .tpu."):
        backends.resolve("tpu")


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_each_entry_names_its_backend_class_its_delegate_and_runner(target):
    backend = backends.load(target.name)
    assert backend.__module__.startswith(target.package) and backend.name == target.name
    if target.delegate_id:
        assert BY_DELEGATE_ID[target.delegate_id] is target
        assert backend_name(target.delegate_id) == target.display_name
    runner = backends.delegate_runner(target.delegate_id) if target.delegate_id else None
    assert (runner is None) == (target.reference_runner is None)
    if runner is not None:
        assert callable(getattr(runner, "execute", None))
    if target.runs_on:
        assert backends.runs_on(target.delegate_id) == target.runs_on
