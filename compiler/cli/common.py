"""What the CLI's commands share: the places they will write, checked before any work starts,
and the backend options given as flags."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from compiler.ir.errors import UserInputError
from compiler.process.writable import prove_file_writable, prove_folder_writable


def backend_options(items: Sequence[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise UserInputError(f"--backend-option {item!r} is not KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def file_to_write(flag: str, path: str | None) -> str | None:
    """A file the run will write: its folder is made now, and a place that cannot be written
    is an error before any work starts, not after the compile. The file itself is created
    to prove it can be (a permission check passes for root where nothing can be made, as
    under /proc), and removed again if the run made it."""
    if path is None:
        return None
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        raise UserInputError(
            f"{flag} {path!r} is a folder", hint=f"give {flag} a file name, e.g. {os.path.join(path, 'model.pte')}"
        )
    folder_to_write(flag, os.path.dirname(os.path.abspath(path)), path)
    try:
        prove_file_writable(path)
    except OSError as exc:
        raise UserInputError(
            f"{flag} {path!r}: the file cannot be written ({exc.strerror})",
            hint=f"give {flag} a place under a folder you can write to",
        ) from None
    return path


def folder_to_write(flag: str, folder: str, given: str | None = None) -> str:
    """A folder the run will write into (`given`: the file in it the user named); a file is
    made and removed in it to prove it can be written."""
    folder = os.path.expanduser(folder)
    named = f"{flag} {given or folder!r}"
    hint = f"give {flag} a place under a folder you can write to"
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UserInputError(f"{named}: cannot create the folder {folder!r} ({exc.strerror})", hint=hint) from None
    try:
        prove_folder_writable(folder)
    except OSError as exc:
        raise UserInputError(f"{named}: no file can be written in the folder {folder!r} ({exc.strerror})", hint=hint) from None
    return folder
