"""Everything the driver must know about a backend is a field of its target or a method of its
`Backend` class: outside `compiler/backends/` and the targets table, no code names a backend (or
its delegate id) as a string, so adding a backend means adding one package and one entry."""

import ast
from pathlib import Path

import pytest

from compiler import backends
from compiler.ir.targets import DEFAULT, TARGETS
from compiler.stages import schemes

ROOT = Path(__file__).resolve().parents[1] / "compiler"
HOMES = ("backends/", "ir/targets.py")
NAMES = {t.name for t in TARGETS} | {t.delegate_id for t in TARGETS if t.delegate_id}


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def named_backends(source: str) -> list[tuple[int, str]]:
    """(line, name) of each string constant, not a docstring, that is a backend's name or delegate id."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return [
        (node.lineno, node.value) for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES
        and id(node) not in docs
    ]


def test_no_module_outside_the_backends_names_a_backend():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(HOMES):
            continue
        found += [f"compiler/{relative}:{line}: {name!r}" for line, name in named_backends(path.read_text())]
    assert not found, "backend names outside compiler/backends and the targets table:\n" + "\n".join(found)


def test_the_scan_sees_a_comparison_and_a_table_key_but_not_a_docstring():
    source = '"""Compile for "xnnpack"."""\nif backend == "coreml":\n    pass\nTABLE = {"MLXBackend": 1}\n'
    assert named_backends(source) == [(2, "coreml"), (4, "MLXBackend")]


def test_the_configuration_default_is_the_targets_default():
    from compiler.driver.config import CompileConfig

    assert CompileConfig().backend == DEFAULT


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_each_target_says_why_of_every_scheme_it_does_not_take(target):
    """A scheme a backend does not take is refused with its reason, from the target's entry."""
    for scheme in schemes.SCHEMES:
        if target.name not in scheme.backends:
            assert scheme.why_not(target.name), f"{scheme.name} on {target.name}: no reason"


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_each_backend_class_finds_its_target(target):
    backend_class = backends.load(target.name)
    assert backend_class.target() is target
    if target.schemes and any(schemes.BY_NAME[s].flow == schemes.PT2E for s in target.schemes):
        scheme = next(schemes.BY_NAME[s] for s in target.schemes if schemes.BY_NAME[s].flow == schemes.PT2E)
        assert backend_class.pt2e_quantizer(scheme, scheme.default_granularity(target.name)) is not None
