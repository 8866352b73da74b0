"""Backends by name. Each backend is its own package; this maps names to them.

Packages are imported on first use, so a backend whose dependencies are heavy
costs nothing until it is asked for; this module itself imports no torch, so the
CLI can list the backends before torch loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Mapping

from compiler.ir.errors import UserInputError

if TYPE_CHECKING:
    from compiler.backends.base import Backend

_REGISTRY = {
    "portable": "compiler.backends.portable:PortableBackend",
    "xnnpack": "compiler.backends.xnnpack:XnnpackBackend",
    "coreml": "compiler.backends.coreml:CoreMLBackend",
    "mlx": "compiler.backends.mlx:MLXBackend",
}


# Delegate id -> the class that runs its payloads in the reference executor
# (`compiler/reference.py`), for delegates the pip runtime lacks:
# `Runner(payload: bytes, executor)` once per delegate, with `.graph_inputs` (how many of
# the call's arguments are inputs) and `.execute(inputs) -> outputs` per call.
_DELEGATE_RUNNERS: dict[str, str] = {
    "MLXBackend": "compiler.backends.mlx.reference:MLXDelegate",
    "CoreMLBackend": "compiler.backends.coreml.reference:CoreMLDelegate",
}


# Delegate id -> the backend package that makes its payloads; a package may say where
# they run (`RUNS_ON`) for the error a machine that cannot run them gives.
_DELEGATE_PACKAGES: dict[str, str] = {
    "CoreMLBackend": "compiler.backends.coreml",
    "MLXBackend": "compiler.backends.mlx",
    "XnnpackBackend": "compiler.backends.xnnpack",
}


def runs_on(delegate_id: str) -> str:
    """Where payloads of this delegate run, as its backend package says."""
    package = _DELEGATE_PACKAGES.get(delegate_id)
    where = getattr(importlib.import_module(package), "RUNS_ON", None) if package else None
    return where or f"a device whose ExecuTorch runtime has the {delegate_id} delegate"


def delegate_runner(delegate_id: str):
    """The reference executor's runner class for this delegate's payloads, or None."""
    found = _DELEGATE_RUNNERS.get(delegate_id)
    if found is None:
        return None
    module_name, class_name = found.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def available() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def load(name: str) -> type[Backend]:
    """The class of the backend named `name` (importing its package and dependencies)."""
    module_name, class_name = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


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
    if not isinstance(backend, str) or backend not in _REGISTRY:
        raise UserInputError(
            f"unknown backend {backend!r}",
            hint=f"use one of: {', '.join(_REGISTRY)}, or pass a compiler.backends.Backend object",
        )
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


__all__ = ["Backend", "BackendPartition", "KeepWhole", "available", "load", "resolve", "runs_on"]
