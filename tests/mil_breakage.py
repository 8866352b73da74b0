"""Ways to leave a Core ML conversion's MIL program invalid on purpose, shared by the tests of
how a failed conversion is reported and of what it leaves behind (any test module imports it
as `mil_breakage`)."""

from __future__ import annotations


def break_block(var) -> None:
    """Leave the MIL block invalid: `var` claims an op reads it that does not."""
    var.add_child_op(var.op)


def break_gelu_converter(monkeypatch) -> None:
    """The GELU converter leaves its output invalid (coremltools validates the converted program)."""
    from compiler.ir.private_api import coreml_converters

    registry = coreml_converters()
    gelu = registry["gelu"]

    def broken_gelu(context, node):
        gelu(context, node)
        break_block(context[node.name])

    monkeypatch.setitem(registry, "gelu", broken_gelu)


def break_in_pass(monkeypatch, pass_name: str) -> list:
    """Make the MIL pass `pass_name` leave the program invalid the first time it runs; the list
    gets the name of the op it broke."""
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    graph_pass = type(PASS_REGISTRY[pass_name])
    apply, broken = graph_pass.apply, []

    def apply_and_break(self, prog):
        apply(self, prog)
        if not broken:
            op = next(op for op in prog.functions["main"].operations if op.op_type != "const")
            break_block(op.outputs[0])
            broken.append(op.name)

    monkeypatch.setattr(graph_pass, "apply", apply_and_break)
    return broken
