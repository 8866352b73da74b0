"""The README's generated sections, each between `<!-- NAME:begin -->` and `<!-- NAME:end -->`.

What the code knows (the options, the MIL ops the Core ML reference interpreter runs) is
written into the README from the code, never by hand, and a test keeps the two equal:

    python -m compiler.tools.readme README.md      # rewrite every generated section
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import Callable

# Section name -> the function (module:name) that returns its text.
GENERATED: dict[str, str] = {
    "options-table": "compiler.driver.config:options_table",
    "coreml-mil-ops": "compiler.backends.coreml.interpreter:coverage_text",
    "portable-kernel-limits": "compiler.stages.cpu_rewrites:limits_table",
}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def _pattern(name: str) -> re.Pattern:
    begin, end = _markers(name)
    return re.compile(re.escape(begin) + r"\n?(.*?)" + re.escape(end), re.S)


def section(text: str, name: str) -> str:
    """The text between `name`'s markers."""
    found = _pattern(name).search(text)
    if found is None:
        begin, end = _markers(name)
        raise ValueError(f"the README has no {begin} ... {end} markers")
    return found.group(1).strip()


def replace_section(text: str, name: str, content: str) -> str:
    section(text, name)  # the markers must be there
    begin, end = _markers(name)
    return _pattern(name).sub(lambda _: f"{begin}\n{content.strip()}\n{end}", text)


def generator(name: str) -> Callable[[], str]:
    module_name, function_name = GENERATED[name].split(":")
    return getattr(importlib.import_module(module_name), function_name)


def write_file(path: str, name: str, content: str) -> None:
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(replace_section(text, name, content))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m compiler.tools.readme README.md")
    for name in GENERATED:
        write_file(sys.argv[1], name, generator(name)())
