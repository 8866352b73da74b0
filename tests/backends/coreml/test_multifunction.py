"""Core ML programs of several methods: the methods' delegates that share a weight are one
multifunction model, stored once, each method running its own function."""

import torch

import compiler
from compiler.backends.coreml.payload import coreml_payloads, read_models, read_reference
from compiler.ir.private_api import deserialize_pte


class Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Linear(256, 256)

    def one(self, x):
        return self.big(x)

    def two(self, x):
        return self.big(x).relu()


def _references(pte: bytes) -> dict[str, dict]:
    program = deserialize_pte(pte).program
    return {
        plan.name: read_reference(bytes(program.backend_delegate_data[d.processed.index].data))
        for plan in program.execution_plan for d in plan.delegates
    }


def test_methods_sharing_a_weight_store_it_once_and_each_runs_its_function():
    torch.manual_seed(0)
    model, x = Shared().eval(), torch.randn(2, 256)
    single = compiler.compile_methods({"one": (model.one, (x,))}, "coreml")
    methods = {"one": (model.one, (x,)), "two": (model.two, (x,))}
    both = compiler.compile_methods(methods, "coreml")
    # Before: each method's payload held the weight, 2.0 times the single method's .pte.
    assert len(both.pte) < 1.05 * len(single.pte), (len(both.pte), len(single.pte))
    links = _references(both.pte)
    assert links["one"]["key"] == links["two"]["key"]
    assert [links[m]["functionName"] for m in ("one", "two")] == ["one", "two"]
    (model_read,) = read_models(both.pte)
    assert model_read.op_types().count("linear") == 2 and "relu" in model_read.op_types()
    check = compiler.check_methods(both, [("one", (x,)), ("two", (x,)), ("one", (x - 1,))])
    assert check.passed and all(row.worst_error < 3e-3 for row in check.methods), check.describe()
    assert compiler.compile_methods(methods, "coreml").pte == both.pte  # the joined model is reproducible


def test_methods_sharing_no_weight_keep_their_own_models():
    torch.manual_seed(0)
    first, second, x = Shared().eval(), Shared().eval(), torch.randn(2, 256)
    result = compiler.compile_methods({"one": (first.one, (x,)), "two": (second.two, (x,))}, "coreml")
    assert set(_references(result.pte).values()) == {None}
    assert len(list(coreml_payloads(result.pte))) == 2
    assert compiler.check_methods(result, [("one", (x,)), ("two", (x,))]).passed
