"""A Core ML payload's intermediate values (`compiler.backends.coreml.taps`, the hook `locate`
reads inside a delegate): each Edge node's value as the payload's MIL program computes it equals
the node's value in the Edge program, and a conversion fault shows at its node and not before it,
in our payloads and in a stock-built `.pte`'s."""

from __future__ import annotations

import operator

import torch

import compiler
from compiler import backends
from compiler.backends.coreml.fixes import fixes_off
from compiler.backends.coreml.taps import intermediate_values


class Mixed(torch.nn.Module):
    """Ops coremltools converts one to one, one it expands (var), and an integer path."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.n = torch.nn.Linear(8, 16), torch.nn.LayerNorm(16)

    def forward(self, x):
        y = self.n(torch.nn.functional.gelu(self.a(x)))
        z = torch.softmax(y * 2, dim=-1).reshape(4, 8).transpose(0, 1)
        return z, (x.sum(-1) > 0).long() + 1, torch.var(y, dim=-1)


class LinearGelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.g, self.b = torch.nn.Linear(16, 32), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.b(self.g(self.a(x)))


def node_values(program, inputs) -> dict[str, torch.Tensor]:
    """Every node's value in `program` run by torch.fx.Interpreter on the user inputs."""
    from torch.export.graph_signature import InputKind

    given = iter(inputs)
    args = []
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            args.append(next(given))
        elif spec.kind == InputKind.PARAMETER or spec.target in program.state_dict:
            args.append(program.state_dict[spec.target])
        else:
            args.append(program.constants[spec.target])
    values = {}

    class Keeping(torch.fx.Interpreter):
        def run_node(self, node):
            values[node.name] = super().run_node(node)
            return values[node.name]

    with torch.no_grad():
        Keeping(program.graph_module).run(*args, enable_io_processing=False)
    return values


def delegate_and_inputs(result, inputs):
    """The one Core ML delegate of a compile and the inputs its call gets (the model's own)."""
    lowered_program = result.stages["lower"].program
    (call,) = [n for n in lowered_program.graph.nodes if getattr(n.target, "__name__", "") == "executorch_call_delegate"]
    lowered = getattr(lowered_program.graph_module, call.args[0].target)
    user = {s.arg.name: i for i, s in enumerate(s for s in lowered_program.graph_signature.input_specs if s.kind.name == "USER_INPUT")}
    return lowered, [inputs[user[a.name]] for a in call.args[1:]]


def error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def test_the_hook_is_registered_for_core_ml():
    assert backends.intermediate_values("CoreMLBackend") is intermediate_values


def test_each_node_inside_the_payload_has_its_edge_value():
    torch.manual_seed(0)
    model, inputs = Mixed().eval(), (torch.randn(2, 8),)
    result = compiler.compile(model, inputs, "coreml", backend_options={"compute_precision": "float32"})
    lowered, given = delegate_and_inputs(result, inputs)
    expected = node_values(result.stages["split_constants"].program, inputs)
    values = intermediate_values(lowered.processed_bytes, given, {}, program=lowered.original_module)
    computed = {
        n.name for n in lowered.original_module.graph.nodes
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
    }
    assert set(values) == computed
    for name, value in values.items():
        want = expected[name]
        assert value.dtype == want.dtype and value.shape == want.shape, name
        assert error(value, want) <= 1e-5 * max(1.0, want.double().abs().max().item()), name
    assert values.ops["aten_gelu_default"] == "gelu (mode EXACT)"
    assert values.ops["aten_permute_copy_default"] == "transpose (perm [1, 0])"
    # The float copy of the constant 2, which coremltools folds: its const keeps the node's name.
    assert values.ops["dim_order_ops__to_dim_order_copy_default"] == "const (folded at conversion)"
    # torch.var is five MIL ops; its value is the payload output in its place.
    assert values.ops["aten_var_dim"] == (
        "reduce_mean (axes [-1], keep_dims True), sub, square, reduce_mean (axes [-1], keep_dims False), mul (y 1.06667)"
    )


def test_a_float16_payload_names_a_node_its_var_name_lost_through_the_debug_handle():
    torch.manual_seed(0)
    model, inputs = Mixed().eval(), (torch.randn(2, 8),)
    result = compiler.compile(model, inputs, "coreml")  # float16: the linear's var is linear_0_cast_fp16
    lowered, given = delegate_and_inputs(result, inputs)
    expected = node_values(result.stages["split_constants"].program, inputs)
    values = intermediate_values(lowered.processed_bytes, given, {}, program=lowered.original_module)
    assert values["aten_linear_default"].dtype == torch.float32 and values.ops["aten_linear_default"] == "linear"
    for name in ("aten_linear_default", "aten_gelu_default", "aten_layer_norm_default", "aten_var_dim"):
        want = expected[name]
        assert error(values[name], want) <= 1e-2 * want.abs().max().item(), name
    assert torch.equal(values["aten_add_tensor"], expected["aten_add_tensor"])


def test_with_the_tanh_gelu_fix_off_the_gelu_node_diverges_and_the_linear_before_it_does_not():
    torch.manual_seed(0)
    model, inputs = LinearGelu().eval(), (torch.randn(4, 16) * 3,)
    options = {"compute_precision": "float32"}
    with fixes_off("tanh_gelu"):
        result = compiler.compile(model, inputs, "coreml", backend_options=options)
    lowered, given = delegate_and_inputs(result, inputs)
    expected = node_values(result.stages["split_constants"].program, inputs)
    values = intermediate_values(lowered.processed_bytes, given, {}, program=lowered.original_module)
    assert error(values["aten_linear_default"], expected["aten_linear_default"]) <= 1e-5
    assert error(values["aten_gelu_default"], expected["aten_gelu_default"]) > 1e-4
    assert values.ops["aten_gelu_default"] == "gelu (mode EXACT)"

    fixed = compiler.compile(model, inputs, "coreml", backend_options=options)
    lowered, given = delegate_and_inputs(fixed, inputs)
    values = intermediate_values(lowered.processed_bytes, given, {}, program=lowered.original_module)
    assert error(values["aten_gelu_default"], expected["aten_gelu_default"]) <= 1e-5
    assert values.ops["aten_gelu_default"] == "gelu (mode TANH_APPROXIMATION)"


def test_a_stock_built_pte_shows_its_tanh_gelu_run_as_the_exact_gelu():
    """Stock ExecuTorch converts GELU(tanh) as the exact GELU. The payload alone, read from the
    stock-built `.pte` (no program: its vars keep the Edge node names), gives the gelu node's
    value, wrong against the value torch computes for that node of stock's Edge program."""
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend as StockCoreML
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from compiler.backends.coreml.payload import coreml_payloads

    torch.manual_seed(0)
    model, inputs = LinearGelu().eval(), (torch.randn(4, 16) * 3,)
    specs = StockCoreML.generate_compile_specs(compute_precision=ct.precision.FLOAT32)
    with torch.no_grad():
        exported = torch.export.export(model, inputs, strict=False)
    manager = to_edge_transform_and_lower(exported, partitioner=[CoreMLPartitioner(compile_specs=specs)])
    edge = manager.exported_program().graph_module.lowered_module_0.original_module  # what stock converted
    expected = node_values(edge, inputs)
    assert torch.allclose(expected["aten_linear_default_1"], model(*inputs), atol=1e-6)  # eager's numbers
    (payload,) = coreml_payloads(manager.to_executorch().buffer)

    values = intermediate_values(payload, list(inputs), {})
    assert error(values["aten_linear_default"], expected["aten_linear_default"]) <= 1e-5
    assert error(values["aten_gelu_default"], expected["aten_gelu_default"]) > 1e-4
    assert values.ops["aten_gelu_default"] == "gelu (mode EXACT)"


class Chunked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.a(x).chunk(3, dim=-1)
        return q * 2 + k * 3 + v * 4


def test_each_item_of_a_split_has_its_own_value_not_the_first_items():
    """The items of a multi-output op share its debug handle; their vars are `<op>_cast_fp16_<i>`."""
    torch.manual_seed(0)
    model, inputs = Chunked().eval(), (torch.randn(2, 8),)
    result = compiler.compile(model, inputs, "coreml")
    lowered, given = delegate_and_inputs(result, inputs)
    expected = node_values(result.stages["split_constants"].program, inputs)
    values = intermediate_values(lowered.processed_bytes, given, {}, program=lowered.original_module)
    items = [n.name for n in lowered.original_module.graph.nodes if n.target is operator.getitem]
    assert len(items) == 3
    for name in items:
        assert error(values[name], expected[name]) <= 1e-2 * expected[name].abs().max().item(), name
