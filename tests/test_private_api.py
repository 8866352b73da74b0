"""Private ExecuTorch and coremltools names are used in compiler/ir/private_api.py only.

Every other file under compiler/ is parsed and checked for:
- an import from an executorch/coremltools module path with an underscored part
  (`executorch.exir.dialects._ops`), or of an underscored name from either package;
- a string naming such a module (`importlib.import_module("executorch...._generated...")`);
- an attribute (`x._op`, `getattr(x, "_op")`) whose name is one of the private names of
  either package this project has used (PRIVATE_ATTRIBUTES below), and closure
  inspection (`__closure__`, `inspect.getclosurevars`).
Torch's own private names (`torch._ops`, `op._schema`...) are not checked here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import compiler

PACKAGE = Path(compiler.__file__).parent
ALLOWED = PACKAGE / "ir" / "private_api.py"
PACKAGES = ("executorch", "coremltools")

# Private attribute and function names of executorch 1.5.1 / coremltools 9.0 that
# compiler/ir/private_api.py wraps. A name reached as an attribute anywhere else is flagged
# (a project-owned attribute must not take one of these names).
PRIVATE_ATTRIBUTES = frozenset(
    {
        # executorch
        "_op",  # EdgeOpOverload._op
        "_EXECUTORCH_SYM_OPS",
        "_PYTHON_SYM_OPS_TO_EXECUTORCH_SYM_OPS",
        "_pybind_schema_to_native_schema",
        "_get_operator_names",
        "_QUANT_PRIMITIVES",
        "_default_decomposition_table",
        "_remove_invalid_ops_for_not_decompose",
        "_register_no_decomp_op",
        "_restore_transformed_ops_to_aten_ops",
        "_get_aten_to_edge_passes",
        "_get_updated_graph_signature",
        "_transform",
        "_verifiers",  # ExportedProgram._verifiers, set to ExecuTorch's Edge verifier
        "_validate",  # ExportedProgram._validate (public: validate())
        "_fixup_flatc_imports",
        "_include_sym_size_nodes_in_partitions",
        "_unsupported_reason",
        "_nearest_source_indices",
        "_UNSUPPORTED_OP_TARGETS",
        "_is_arg_min_max_over_flattened_input",
        "_mark_node_supported",  # MLXProgramBuilder's, for compiler.backends.mlx.taps
        "_slot_to_final_tid",
        "_chains",
        "_can_merge_partitions",  # GroupBasedPartitioner's
        "_named_data_store_output",  # LoweredBackendModule's
        # coremltools
        "_TORCH_OPS_REGISTRY",
    }
)
CLOSURE_INSPECTION = frozenset({"__closure__", "getclosurevars"})
_ATTRIBUTE_CALLS = ("getattr", "hasattr", "setattr", "delattr")


def _private_module(name: str | None) -> bool:
    parts = (name or "").split(".")
    return parts[0] in PACKAGES and any(p.startswith("_") for p in parts[1:])


def _ours(name: str | None) -> bool:
    return (name or "").split(".")[0] in PACKAGES


def _private_name(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations(path: Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    name = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path.name
    where = lambda node: f"{name}:{node.lineno}"  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _private_module(alias.name):
                    found.append(f"{where(node)}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _ours(node.module):
            names = [a.name for a in node.names if _private_name(a.name)]
            if _private_module(node.module) or names:
                found.append(f"{where(node)}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if " " not in node.value and _private_module(node.value):
                found.append(f"{where(node)}: names the private module {node.value!r}")
        elif isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_ATTRIBUTES or node.attr in CLOSURE_INSPECTION:
                found.append(f"{where(node)}: {ast.unparse(node)}")
        elif isinstance(node, ast.Name) and node.id in CLOSURE_INSPECTION:
            found.append(f"{where(node)}: {node.id}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ATTRIBUTE_CALLS
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and (node.args[1].value in PRIVATE_ATTRIBUTES or node.args[1].value in CLOSURE_INSPECTION)
        ):
            found.append(f"{where(node)}: {ast.unparse(node)}")
    return found


def test_private_names_only_in_private_api():
    found = [v for path in sorted(PACKAGE.rglob("*.py")) if path != ALLOWED for v in violations(path)]
    assert not found, (
        "private executorch/coremltools names outside compiler/ir/private_api.py "
        "(add a wrapper there and call it):\n" + "\n".join(found)
    )


def test_the_check_sees_each_kind_of_use(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import inspect\n"
        "from executorch.exir.dialects._ops import ops\n"
        "from executorch.exir.tracer import _default_decomposition_table\n"
        "import coremltools.converters.mil.frontend.torch._x\n"
        "NAME = 'executorch.backends.mlx.serialization._generated.mlx_delegate'\n"
        "def f(target, fn):\n"
        "    a = target._op\n"
        "    b = getattr(target, '_op', None)\n"
        "    c = fn.__closure__\n"
        "    d = inspect.getclosurevars(fn)\n"
        "    e = target._schema  # torch's: not flagged\n"
    )
    lines = sorted(int(v.split(":")[1]) for v in violations(sample))
    assert lines == [2, 3, 4, 5, 7, 8, 9, 10]


def test_private_api_imports_nothing_from_compiler_but_errors():
    tree = ast.parse(ALLOWED.read_text())
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    } | {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert {m for m in imported if m.split(".")[0] == "compiler"} <= {"compiler.ir.errors"}


def test_private_api_imports_lazily():
    """Importing it imports neither package (coremltools only when a Core ML entry is asked for)."""
    import subprocess
    import sys

    # compiler/__init__ may import executorch itself; load the module by path to test it alone.
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('private_api', {str(ALLOWED)!r}); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "print(sorted(m for m in ('executorch', 'coremltools') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
