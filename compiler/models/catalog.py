"""The models a MODEL spec can name, known without importing torch.

`python -m compiler examples`, `--help` and a mistyped model name answer before
torch loads, so the names, one-line descriptions and default sizes are read from
the source of `compiler.models.examples` and `compiler.models.model_suite` (their `EXAMPLES`
and `SUITE` dicts and the factories' docstrings), not by importing them.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os

import attrs

from compiler.ir.errors import UserInputError


@attrs.frozen
class ModelEntry:
    name: str
    description: str  # the factory's docstring, with its keyword arguments and defaults
    needs_models_extra: bool  # a transformers model (pip install -e '.[models]')


def _entries(module: str, registry: str, needs_models_extra: bool) -> list[ModelEntry]:
    path = importlib.util.find_spec(module).origin
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    table = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == registry
    )
    entries = []
    for key, value in zip(table.keys, table.values):
        factory = functions[value.id]
        arguments = factory.args.args[len(factory.args.args) - len(factory.args.defaults):]
        defaults = ", ".join(f"{a.arg}={ast.literal_eval(d)}" for a, d in zip(arguments, factory.args.defaults))
        doc = ast.get_docstring(factory).strip()
        entries.append(ModelEntry(key.value, f"{doc} [{defaults}]", needs_models_extra))
    return entries


@functools.cache
def models() -> dict[str, ModelEntry]:
    """Every model a MODEL spec can name: the built-in examples, then the transformers suite."""
    found = _entries("compiler.models.examples", "EXAMPLES", False) + _entries("compiler.models.model_suite", "SUITE", True)
    return {entry.name: entry for entry in found}


def check_model_spec(spec: str) -> None:
    """A MODEL spec that cannot name a model is an error before anything is imported."""
    head, _, tail = spec.partition(":")
    if head.endswith(".py") or os.sep in head:
        if not os.path.isfile(head):
            raise UserInputError(f"MODEL file {head!r} does not exist", hint="give path/to/file.py:factory")
        if not tail:
            raise UserInputError(
                f"MODEL {spec!r} names no factory", hint="give path/to/file.py:factory, a function in that file"
            )
    elif head not in models():
        raise UserInputError(
            f"MODEL {spec!r} is neither a built-in example nor path/to/file.py:factory",
            hint=f"built-in models: {', '.join(models())} (see `python -m compiler examples`)",
        )
