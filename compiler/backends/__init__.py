"""Backends by name. Each backend is its own package; `compiler.ir.targets` holds one
entry per backend (name, display name, package, delegate id, reference runner).

Packages are imported on first use, so a backend whose dependencies are heavy
costs nothing until it is asked for; this module itself imports no torch, so the
CLI can list the backends before torch loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Mapping

from compiler.ir.errors import UserInputError
from compiler.ir.targets import BY_DELEGATE_ID, BY_NAME, Target

if TYPE_CHECKING:
    from compiler.backends.base import Backend

def runs_on(delegate_id: str) -> str:
    """Where payloads of this delegate run, as its backend's entry says."""
    target = BY_DELEGATE_ID.get(delegate_id)
    return (target and target.runs_on) or f"a device whose ExecuTorch runtime has the {delegate_id} delegate"


def delegate_runner(delegate_id: str):
    """The reference executor's runner class for this delegate's payloads, or None."""
    target = BY_DELEGATE_ID.get(delegate_id)
    if target is None or target.reference_runner is None:
        return None
    module_name, class_name = target.reference_runner.split(":")
    return getattr(importlib.import_module(module_name), class_name)


# Delegate id -> "module:function" that reads a payload's intermediate values:
#   intermediate_values(processed: bytes, inputs: Sequence[Tensor], named_data: Mapping[str, bytes],
#                       program: ExportedProgram | None = None) -> compiler.backends.taps.PayloadValues
# `processed` the payload, `inputs` the delegate call's inputs, `named_data` the data the payload's
# lowering stored outside it (key -> bytes), `program` the delegate's original program
# (`LoweredBackendModule.original_module`: its node names, dtypes and outputs; MLX payloads keep no
# names and need it, Core ML's then also match nodes through debug handles). The result is a dict
# keyed by the names of the Edge nodes the payload's ops came from (the delegate's original
# program's node names), each the value of that node as the payload computes it, in the node's
# dtype unless the payload computes another kind of number (`compiler.backends.taps.node_value`);
# its `ops` maps the same names to the payload ops that compute each ("gelu (mode EXACT)").
# `compiler.tools.locate` reads values inside a payload through it; for a delegate without one
# (XNNPACK), or whose function raises a CompileError, it cuts the delegate instead. An entry whose
# module has no such function yet counts as absent.
INTERMEDIATE_VALUES: dict[str, str] = {
    "CoreMLBackend": "compiler.backends.coreml.taps:intermediate_values",
    "MLXBackend": "compiler.backends.mlx.taps:intermediate_values",
}


def _function(table: Mapping[str, str], delegate_id: str):
    """The function a "module:function" entry of `table` names for this delegate, or None."""
    where = table.get(delegate_id)
    if where is None:
        return None
    module_name, function_name = where.split(":")
    return getattr(importlib.import_module(module_name), function_name, None)


def intermediate_values(delegate_id: str):
    """The function that reads this delegate's intermediate values inside a payload, or None."""
    return _function(INTERMEDIATE_VALUES, delegate_id)


# Delegate id -> "module:function" giving the keys of the named data a payload reads:
#   named_data_keys(processed: bytes) -> frozenset[str]
# The runtime checks them against the program's own named data before loading a program given
# without a data file (a delegate whose runtime crashes on a missing key needs one).
NAMED_DATA_KEYS: dict[str, str] = {
    "XnnpackBackend": "compiler.backends.xnnpack.named_data:named_data_keys",
}


def named_data_keys(delegate_id: str):
    """The function that lists the named data keys a payload of this delegate reads, or None."""
    return _function(NAMED_DATA_KEYS, delegate_id)


def available() -> tuple[str, ...]:
    return tuple(BY_NAME)


def target(name: str) -> Target:
    """The targets table's entry for the backend named `name`; an unknown name is the user's error."""
    if not isinstance(name, str) or name not in BY_NAME:
        raise UserInputError(
            f"unknown backend {name!r}",
            hint=f"use one of: {', '.join(BY_NAME)}, or pass a compiler.backends.Backend object",
        )
    return BY_NAME[name]


def load(name: str) -> type[Backend]:
    """The class of the backend named `name` (importing its package and dependencies)."""
    entry = target(name)
    return getattr(importlib.import_module(entry.package), entry.class_name)


def resolve(backend: str | Backend, options: Mapping[str, Any] | None = None) -> Backend:
    """The backend object for a name (built with `options`) or a ready backend object."""
    from compiler.backends.base import Backend

    if isinstance(backend, Backend):
        if options:
            raise UserInputError(
                "backend_options were given with a backend object",
                hint="build the backend object with those options instead",
            )
        return backend
    backend_class = load(backend)
    known = backend_class.option_names()
    unknown = sorted(set(options or {}) - set(known))
    if unknown:
        raise UserInputError(
            f"the {backend} backend has no option {', '.join(map(repr, unknown))}",
            hint=f"its options are: {', '.join(known) or 'none'}",
        )
    try:
        return backend_class(**dict(options or {}))
    except TypeError as exc:
        raise UserInputError(
            f"backend {backend!r} does not take these options: {exc}",
            hint=f"its options are: {', '.join(known) or 'none'}",
        ) from exc


def __getattr__(name: str):
    if name in ("Backend", "BackendPartition", "KeepWhole"):
        from compiler.backends import base

        return getattr(base, name)
    raise AttributeError(f"module 'compiler.backends' has no attribute {name!r}")


__all__ = ["Backend", "BackendPartition", "KeepWhole", "available", "intermediate_values", "load", "resolve", "runs_on"]
