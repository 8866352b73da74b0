"""`compiler.locate_program`: locate on a `.pte` compiled elsewhere (stock ExecuTorch's), given
the eager model and inputs: a stock Core ML program's tanh GELU run as the exact GELU is named at
its gelu node with its payload op; a stock XNNPACK program of a correct model agrees; a `.pte`
whose CPU kernel call was given another argument is named at that node; the CLI form."""

from __future__ import annotations

import torch

import compiler

GELU_MODEL = '''
import torch


class LinearGelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.g, self.b = torch.nn.Linear(16, 32), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.b(self.g(self.a(x)))


def make():
    torch.manual_seed(0)
    return LinearGelu().eval(), (torch.randn(4, 16) * 3,)
'''


def _gelu_model(tmp_path):
    source = tmp_path / "gelu_model.py"
    source.write_text(GELU_MODEL)
    namespace: dict = {}
    exec(compile(GELU_MODEL, str(source), "exec"), namespace)  # its nodes' source lines name this file
    model, inputs = namespace["make"]()
    return source, model, inputs


def _stock_coreml(model, inputs, precision: str) -> bytes:
    """What stock ExecuTorch 1.5.1 builds: its Core ML partitioner converting at `precision`."""
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner
    from executorch.exir import to_edge_transform_and_lower

    specs = CoreMLBackend.generate_compile_specs(compute_precision=getattr(ct.precision, precision.upper()))
    with torch.no_grad():
        exported = torch.export.export(model, inputs, strict=False)
    return to_edge_transform_and_lower(exported, partitioner=[CoreMLPartitioner(compile_specs=specs)]).to_executorch().buffer


def test_a_stock_core_ml_pte_is_located_at_its_gelu_run_as_the_exact_gelu(tmp_path):
    source, model, inputs = _gelu_model(tmp_path)
    pte = _stock_coreml(model, inputs, "float32")

    location = compiler.locate_program(pte, model, inputs)

    assert location.stage == "the .pte"
    d = location.divergence
    assert d is not None, location.describe()
    assert (d.node, d.op) == ("aten_gelu_default", "aten.gelu.default")
    assert d.payload_op == "gelu (mode EXACT)"
    assert "CoreMLBackend" in d.delegate and "intermediate values" in d.found_by
    assert d.output_error > d.tolerance == 1e-4
    assert dict(d.input_errors)["aten_linear_default"] <= 1e-5
    assert d.source.startswith(f"{source}:11") and d.module == "g (GELU)"
    assert [s.node for s in location.path] == ["x", "aten_linear_default", "aten_gelu_default"]
    assert [row.stage for row in location.stages] == ["eager", "edge", "the .pte"]
    assert location.stages[-1].passed is False and location.stages[1].passed


def test_a_float16_stock_core_ml_pte_agrees_at_float16s_tolerance_and_says_so(tmp_path):
    _, model, inputs = _gelu_model(tmp_path)
    location = compiler.locate_program(_stock_coreml(model, inputs, "float16"), model, inputs)
    assert not location.found
    assert "agree at float16's tolerance" in location.note and "cannot be converted again" in location.note


def test_a_stock_xnnpack_pte_of_a_correct_model_agrees(tmp_path):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    inputs = (torch.randn(4, 16),)
    exported = torch.export.export(model, inputs, strict=False)
    path = tmp_path / "mlp.pte"
    path.write_bytes(to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)

    location = compiler.locate_program(path, model, inputs)

    assert not location.found and location.divergence is None
    (row,) = [r for r in location.stages if r.stage == "the .pte"]
    assert row.passed and row.ran.startswith("ExecuTorch's runtime") and row.max_error <= row.tolerance
    assert "every stage's outputs agree with eager" in location.describe()


def test_a_cpu_kernel_call_given_another_argument_is_named_at_its_node():
    """A portable `.pte` whose add was given alpha 3 where the model says 2: the reference executor's
    value of that instruction, matched to the Edge node by the order of ops, is the first wrong one."""
    from executorch.exir import schema, to_edge
    from executorch.exir._serialize._program import deserialize_pte_binary, serialize_pte_binary

    class Add(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.b(torch.add(torch.relu(self.a(x)), x, alpha=2))

    torch.manual_seed(0)
    model, inputs = Add().eval(), (torch.randn(2, 8),)
    pte = deserialize_pte_binary(to_edge(torch.export.export(model, inputs, strict=False)).to_executorch().buffer)
    plan = pte.program.execution_plan[0]
    (add,) = [i.instr_args for i in plan.chains[0].instructions
              if isinstance(i.instr_args, schema.KernelCall) and plan.operators[i.instr_args.op_index].name == "aten::add"]
    (alpha,) = [plan.values[i].val for i in add.args if isinstance(plan.values[i].val, schema.Int)]
    alpha.int_val = 3

    location = compiler.locate_program(bytes(serialize_pte_binary(pte)), model, inputs)

    d = location.divergence
    assert d is not None, location.describe()
    assert d.node == "aten_add_tensor" and d.delegate is None and "matched by the order of ops" in d.found_by
    assert dict(d.input_errors) == {"aten_relu_default": 0.0, "x": 0.0}


def test_the_locate_command_locates_a_pte_given_with_program(tmp_path, capsys):
    from compiler.cli.main import main

    source, model, inputs = _gelu_model(tmp_path)
    pte = tmp_path / "stock.pte"
    pte.write_bytes(_stock_coreml(model, inputs, "float32"))
    found = tmp_path / "found.json"

    status = main(["locate", f"{source}:make", "--program", str(pte), "--report-json", str(found)])

    assert status == 1
    out = capsys.readouterr().out
    assert "the outputs first diverge from eager at stage 'the .pte'" in out
    assert "first diverging node: aten_gelu_default (aten.gelu.default)" in out
    assert "payload op: gelu (mode EXACT)" in out
    assert '"node": "aten_gelu_default"' in found.read_text()
    assert main(["locate", f"{source}:make", "--program", str(pte), "--report-html", str(tmp_path / "r.html")]) == 2
