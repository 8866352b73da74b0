"""docs/DESIGN.md's layout names every module and package of each layer, and every layer of the
import contracts: a module added without a word there fails here."""

import re
import tomllib
from pathlib import Path

from compiler.stages import STAGES

ROOT = Path(__file__).resolve().parents[1]


def _layout() -> dict[str, str]:
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    block = text.split("## Layout and dependency direction", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    layers: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        head = re.match(r"^(compiler\.\w+)\s+(.*)", line)
        if head:
            current = head.group(1)
            layers[current] = head.group(2)
        elif current:
            layers[current] += " " + line.strip(" |")
    return layers


def test_the_layout_lists_the_contracts_layers_in_their_order():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    [layered] = [c for c in contracts if c["type"] == "layers"]
    assert list(_layout()) == layered["layers"]


def test_every_module_is_named_in_its_layer():
    stage_modules = {row.name for row in STAGES}  # "one module per stage": the STAGES table names them
    missing = []
    for layer, words in _layout().items():
        package = ROOT / layer.replace(".", "/")
        if not package.is_dir():  # a module layer (compiler.api)
            continue
        names = [p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
        names += [p.name for p in package.iterdir() if (p / "__init__.py").exists()]
        if layer == "compiler.stages":
            names = [n for n in names if n not in stage_modules]
        missing += [f"{layer}.{name}" for name in names if not re.search(rf"\b{name}\b", words)]
    assert not missing, f"docs/DESIGN.md's layout does not name: {', '.join(sorted(missing))}"
