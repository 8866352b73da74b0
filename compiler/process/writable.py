"""Proving that a path can be written, before the work that will write it.

`os.access` answers for permissions only, and for root it says yes where nothing can be
made (`/proc`, a read-only mount): the only sure test is to make the file.
"""

from __future__ import annotations

import os
import tempfile


def prove_file_writable(path: str) -> None:
    """Creates `path` (raising the OSError if it cannot be) and removes it again if it was not there."""
    existed = os.path.exists(path)
    with open(path, "ab"):
        pass
    if not existed:
        os.remove(path)


def prove_folder_writable(folder: str) -> None:
    """Makes and removes a file in `folder`, raising the OSError if that cannot be done."""
    with tempfile.TemporaryFile(dir=folder):
        pass
