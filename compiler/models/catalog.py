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


# What a `save_pretrained` folder can be compiled for (`FOLDER:TASK`): optimum-executorch's task names.
TASKS = ("text-generation", "feature-extraction", "fill-mask", "image-classification")


def is_checkpoint_spec(spec: str) -> bool:
    """Whether MODEL names a folder (`FOLDER` or `FOLDER:TASK`) rather than an example or a file."""
    return os.path.isdir(spec.partition(":")[0])


def with_task(spec: str, task: str | None) -> str:
    """MODEL with `--task` joined to a folder that names none (`FOLDER` -> `FOLDER:TASK`)."""
    if task is None:
        return spec
    head, _, tail = spec.partition(":")
    if not os.path.isdir(head):
        raise UserInputError(f"--task {task} is for a save_pretrained folder; MODEL {spec!r} is not one",
                             hint="give MODEL as the folder save_pretrained wrote, or drop --task")
    if tail and tail != task:
        raise UserInputError(f"MODEL {spec!r} names the task {tail!r} and --task {task!r}", hint="give the task once")
    return f"{head}:{task}"


def check_model_spec(spec: str) -> None:
    """A MODEL spec that cannot name a model is an error before anything is imported."""
    head, _, tail = spec.partition(":")
    if os.path.isdir(head):
        if not os.path.isfile(os.path.join(head, "config.json")):
            raise UserInputError(f"MODEL folder {head!r} holds no config.json", hint="give the folder save_pretrained wrote")
        if tail not in TASKS:
            raise UserInputError(
                f"MODEL {spec!r}: a save_pretrained folder needs a task" + (f", not {tail!r}" if tail else ""),
                hint=f"give --task (or FOLDER:TASK): one of {', '.join(TASKS)}",
            )
    elif head.endswith(".py") or os.sep in head:
        if not os.path.isfile(head):
            raise UserInputError(f"MODEL file {head!r} does not exist", hint="give path/to/file.py:factory")
        if not tail:
            raise UserInputError(
                f"MODEL {spec!r} names no factory", hint="give path/to/file.py:factory, a function in that file"
            )
    elif head not in models():
        raise UserInputError(
            f"MODEL {spec!r} is neither a built-in example, path/to/file.py:factory nor a save_pretrained folder",
            hint=f"built-in models: {', '.join(models())} (see `python -m compiler examples`)",
        )
