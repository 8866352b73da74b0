"""The documentation's generated sections, each between `<!-- NAME:begin -->` and `<!-- NAME:end -->`.

What the code knows (the options, the MIL ops the Core ML reference interpreter runs, the
portable kernels' limits) is written into the docs from the code, never by hand, and a
test (tests/test_readme.py) keeps the two equal:

    python -m compiler.tools.readme          # rewrite every generated section in its file

Paths are relative to the project's root (the folder holding README.md), where the
command is run. The model suite's results table is measured, not generated from the
code: `python -m benchmarks.model_suite --doc docs/model-suite.md` writes it, and
`python -m benchmarks.quantization` the quantization table of docs/quantization.md, and
`python -m benchmarks.generation` the text-generation table of docs/generation.md, and
`python -m benchmarks.performance` the performance section of docs/performance.md from the benchmarks' results.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Callable, NamedTuple


class Generated(NamedTuple):
    document: str  # the file holding the section, relative to the project's root
    function: str  # module:name of the function that returns its text


# Section name -> where it lives and what generates it.
GENERATED: dict[str, Generated] = {
    "options-table": Generated("docs/options.md", "compiler.driver.config:options_table"),
    "coreml-mil-ops": Generated("docs/backends.md", "compiler.backends.coreml.interpreter:coverage_text"),
    "portable-kernel-limits": Generated("docs/stages.md", "compiler.passes.cpu_rewrites:limits_table"),
    "quantize-schemes": Generated("docs/quantization.md", "compiler.stages.schemes:scheme_table"),
}

# Sections a benchmark writes from what it measured: name -> the file holding it.
MEASURED: dict[str, str] = {
    "model-suite-table": "docs/model-suite.md",
    "quantization-table": "docs/quantization.md",
    "generation-table": "docs/generation.md",
    "optimum-comparison-table": "docs/benchmarks.md",
    "performance-table": "docs/performance.md",
}


def document(name: str) -> str:
    """The file (relative to the project's root) that holds section `name`."""
    return GENERATED[name].document if name in GENERATED else MEASURED[name]


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
        raise ValueError(f"the text has no {begin} ... {end} markers")
    return found.group(1).strip()


def replace_section(text: str, name: str, content: str) -> str:
    section(text, name)  # the markers must be there
    begin, end = _markers(name)
    return _pattern(name).sub(lambda _: f"{begin}\n{content.strip()}\n{end}", text)


def generator(name: str) -> Callable[[], str]:
    module_name, function_name = GENERATED[name].function.split(":")
    return getattr(importlib.import_module(module_name), function_name)


def write_file(path: str, name: str, content: str) -> None:
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(replace_section(text, name, content))


def write_all(root: str = ".") -> None:
    """Rewrite every generated section in its file under `root`."""
    for name in GENERATED:
        write_file(os.path.join(root, document(name)), name, generator(name)())


if __name__ == "__main__":
    if len(sys.argv) > 2:
        raise SystemExit("usage: python -m compiler.tools.readme [PROJECT_ROOT]")
    given = sys.argv[1] if len(sys.argv) == 2 else "."
    # The older spelling named the README (`... readme README.md`): its folder is the root.
    write_all(given if os.path.isdir(given) else os.path.dirname(given) or ".")
