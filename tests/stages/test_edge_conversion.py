"""Our Edge conversion runs ExecuTorch's passes, skipping those that cannot apply and
rewriting in place those that only swap ops: the result must be exactly what stock's
conversion gives, once the ATen ops stock leaves behind are made Edge ops. Exactly: the
code and signature, and per node its target and the metadata later stages read (values
with their layout and grad flag, debug handles, provenance, stack traces)."""

import re

import pytest
import torch
from torch.utils import _pytree as pytree

import compiler
from compiler.models import model_suite
from compiler.models.examples import Transformer, transformer
from compiler.passes.decomposition import decompose
from compiler.passes.tracing import unbacked_symbols_kept_in
from compiler.stages.dry_run import _aten_origin
from compiler.passes.edge_conversion import _finish_edge_ops, generate_edge_program
from executorch.exir import EdgeCompileConfig, to_edge
from executorch.exir.program._program import _generate_edge_program
from stages.test_unbacked_symbols import FirstPositives  # tests/stages/: an unbacked symbol sizes the output


class MixedTypes(torch.nn.Module):
    def forward(self, x, n):
        return (n * 1.5 + x).t(), n // 2 + 1, (x > 0) * 3


class SymbolicSize(torch.nn.Module):
    def forward(self, x):
        return x * x.shape[0] + torch.ones(1) * x.shape[0]


class ScalarOperand(torch.nn.Module):
    """`aten.add.Tensor(x, 2.0)`, a number for a tensor: ScalarToTensorPass makes it a
    constant (a get_attr node), and the passes after it must retrace."""

    def forward(self, x):
        return (x.permute(1, 0) + 2.0).sum(0)


def bench(depth):
    """The benchmark's block stack (`python -m benchmarks`: d=256, 4 heads, seq 64)."""
    torch.manual_seed(0)
    return Transformer(depth, 256, 4).eval(), (torch.randn(1, 64, 256),)


def _tensor(value):
    """What a value is to later stages: a tensor's shape, dtype, strides and grad flag."""
    if isinstance(value, torch.Tensor):
        return (type(value).__name__, tuple(value.shape), value.dtype, value.stride(), value.requires_grad)
    if isinstance(value, (list, tuple)):
        return type(value).__name__, [_tensor(v) for v in value]
    return type(value).__name__, str(value)


def _sources(sources):
    """A `from_node` chain without graph ids (those of the two decompositions differ)."""
    return [(s.name, str(s.target), s.pass_name, str(s.action), _sources(s.from_node)) for s in sources or []]


def _plain(value):
    """A metadata entry with its tensors described (`eager_input_vals` holds fake tensors)."""
    return pytree.tree_map(lambda v: _tensor(v) if isinstance(v, torch.Tensor) else v, value)


# How a metadata entry is compared; the ones not named here with `_plain`.
META = {
    "val": _tensor,
    "from_node": _sources,
    "tensor_meta": str,
    "original_aten": str,  # each decomposition makes its own EDGE_DO_NOT_DECOMP op objects
    "seq_nr": lambda _: None,  # the autograd counter when each input was decomposed
}


def assert_same_program(ours, stock, unbacked=False):
    """`unbacked`: each retrace of an op reading a number at run time makes a fresh unbacked
    symbol (u4, u5...), and the range constraints list every one made; skipping a retrace
    that cannot change the graph makes fewer, so the graph's symbols are compared unnumbered."""
    unnumbered = (lambda text: re.sub(r"\bu\d+\b", "u", text)) if unbacked else (lambda text: text)
    assert unnumbered(ours.graph_module.code) == unnumbered(stock.graph_module.code)
    assert str(ours.graph_signature) == str(stock.graph_signature)
    if not unbacked:
        assert str(ours.range_constraints) == str(stock.range_constraints)
    for node, want in zip(ours.graph.nodes, stock.graph.nodes, strict=True):
        assert (node.name, node.op, node.target) == (want.name, want.op, want.target)
        assert set(node.meta) == set(want.meta), node.name
        for key, value in node.meta.items():
            same = META.get(key, _plain)
            if unbacked:
                same = lambda v, same=same: unnumbered(repr(same(v)))  # noqa: E731
            assert same(value) == same(want.meta[key]), f"{node.name}: meta[{key!r}]"
        assert _aten_origin(node) == _aten_origin(want), node.name


def _has_unbacked_symbol(program) -> bool:
    return any(
        str(s).startswith("u")
        for n in program.graph.nodes
        for v in pytree.tree_leaves(n.meta.get("val"))
        if isinstance(v, (torch.Tensor, torch.SymInt))
        for s in (v.shape if isinstance(v, torch.Tensor) else [v])
        if isinstance(s, torch.SymInt)
    )


def convert_both(model, inputs, backend):
    """(ours, stock's) Edge program for `model` at the decompose stage, each from its own
    capture (their symbols then come from shape environments in the same state); also the
    ATen node names kept whole."""
    programs = []
    for convert in ("stock", "ours"):
        planned = compiler.compile(model, inputs, backend, stop_after="dry_run").artifact
        keep = planned.keep_whole.nodes
        with unbacked_symbols_kept_in(planned.program):  # as the decompose stage runs it
            program, preserved = decompose(planned.program, keep)
            if convert == "stock":
                edge = _generate_edge_program(EdgeCompileConfig(), program, preserve_ops=preserved)
                _finish_edge_ops(edge)  # the one intended difference: leftover ATen ops become Edge ops
            else:
                edge, _ = generate_edge_program(program, preserved)
        programs.append(edge)
    stock, ours = programs
    assert_same_program(ours, stock, unbacked=_has_unbacked_symbol(stock))
    return ours, keep


def cases():
    dim = torch.export.Dim("batch", min=2, max=32)
    return [
        ("transformer", *transformer(depth=1), None),
        ("mixed", MixedTypes(), (torch.randn(3, 3), torch.randint(0, 9, (3, 3))), None),
        ("symbolic", SymbolicSize(), (torch.randn(4, 3),), ({0: dim},)),
        ("scalar", ScalarOperand(), (torch.randn(3, 4),), None),
        ("unbacked", FirstPositives(), (torch.randn(5), torch.randn(5, 3)), None),
    ]


@pytest.mark.parametrize("name, model, inputs, dynamic", cases(), ids=[c[0] for c in cases()])
def test_same_program_as_stock_conversion(name, model, inputs, dynamic):
    # Each conversion from its own capture: their symbols (unbacked ones are numbered as
    # they are made) then come from shape environments in the same state.
    aten = compiler.compile(model, inputs, "xnnpack", stop_after="fold", dynamic_shapes=dynamic).artifact.program
    keep = {n.name for n in aten.graph.nodes if n.target == torch.ops.aten.linear.default}
    with unbacked_symbols_kept_in(aten):  # as the decompose stage runs it
        program, preserved = decompose(aten, keep)
        stock = _generate_edge_program(EdgeCompileConfig(), program, preserve_ops=preserved)
        _finish_edge_ops(stock)
    aten = compiler.compile(model, inputs, "xnnpack", stop_after="fold", dynamic_shapes=dynamic).artifact.program
    with unbacked_symbols_kept_in(aten):
        program, preserved = decompose(aten, keep)
        ours, skipped = generate_edge_program(program, preserved)
    assert_same_program(ours, stock, unbacked=name == "unbacked")
    expected_to_run = {"mixed": "RemoveMixedTypeOperators", "symbolic": "SymToTensorPass", "scalar": "ScalarToTensorPass"}
    if name in expected_to_run:
        assert expected_to_run[name] not in skipped
    elif name != "unbacked":
        assert {"RemoveMixedTypeOperators", "SymToTensorPass", "ReplaceBrokenOpsWithFunctionalOpsPass"} <= set(skipped)


@pytest.mark.parametrize("backend", ["coreml", "xnnpack"])
def test_benchmark_stack_same_program_as_stock(backend):
    ours, keep = convert_both(*bench(2), backend)
    # Provenance still leads from each Edge node back to the ATen node it was made from:
    # every node kept whole is found again (the dry run relies on it).
    assert keep and set(keep) <= {_aten_origin(n) for n in ours.graph.nodes if n.op == "call_function"}


@pytest.mark.slow
def test_deep_benchmark_stack_same_program_as_stock():
    convert_both(*bench(12), "coreml")


# Models whose Edge conversion stock refuses, so there is no stock program to compare with.
STOCK_EDGE_REFUSES = {
    "smolvlm": "stock's Edge verifier refuses the torch.sym_not / sym_ite of its size checks, which ours rewrites",
}


@pytest.mark.models
@pytest.mark.parametrize("backend", ["coreml", "xnnpack"])
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.xfail(reason=STOCK_EDGE_REFUSES[name], raises=AssertionError, strict=True)])
        if name in STOCK_EDGE_REFUSES
        else name
        for name in sorted(model_suite.SUITE)
    ],
)
def test_model_suite_same_program_as_stock(name, backend):
    pytest.importorskip("transformers")
    convert_both(*model_suite.SUITE[name](), backend)


def test_aten_program_unchanged():
    """The in-place rewrites change the decomposed program only: values it shares with the
    ATen program (which the decompose stage decomposes again after the dry run) stay as
    they were, grad flags included (SDPA's fake kernel picks its output layout by them)."""
    planned = compiler.compile(*bench(1), "coreml", stop_after="dry_run").artifact
    before = [(n.name, _plain(n.meta.get("val"))) for n in planned.program.graph.nodes]
    program, preserved = decompose(planned.program, planned.keep_whole.nodes)
    generate_edge_program(program, preserved)
    assert [(n.name, _plain(n.meta.get("val"))) for n in planned.program.graph.nodes] == before


class CheckedSizes(torch.nn.Module):
    """Checks export keeps as runtime assertions, as VLMs' image-token merges check theirs: a
    count that must not be zero (asserted through `torch.sym_not`), which lets `to_executorch`
    order the strides of the transposed copy, and a tensor condition (through `torch.sym_ite`)."""

    def forward(self, x, mask, counts):
        picked = x[mask]
        torch._check(picked.shape[0] != 0)
        torch._check_tensor_all(counts % 2 == 0)
        return picked.t().contiguous().sum(1) * counts.sum()


def checked_inputs():
    return torch.randn(6, 4), torch.tensor([True, False, True, True, False, False]), torch.tensor([2, 4])


def _helpers(program) -> set:
    return {n.target for n in program.graph.nodes} & {torch.sym_not, torch.sym_ite}


def test_stock_to_edge_refuses_the_symbolic_helpers_of_assertions():
    program = torch.export.export(CheckedSizes(), checked_inputs())
    assert _helpers(program) == {torch.sym_not, torch.sym_ite}
    # (`_is_all_true` stays whole in stock's decomposition; let it through to reach the helpers)
    config = EdgeCompileConfig(_core_aten_ops_exception_list=[torch.ops.aten._is_all_true.default])
    with pytest.raises(AssertionError):  # the Edge verifier takes no Python function but `alloc`
        to_edge(program, compile_config=config)


@pytest.mark.parametrize("backend", ["portable", "xnnpack", "coreml", "mlx"])
def test_assertions_on_symbolic_helpers_are_dropped_and_the_program_matches_eager(backend):
    model, args = CheckedSizes().eval(), checked_inputs()
    artifact = compiler.compile(model, args, backend)
    assert not _helpers(artifact.stages["decompose"].program)
    check = compiler.compare_with_eager(artifact, model, args)  # float16's tolerance on Core ML
    assert check.passed, check.describe()


class HelperSizesATensor(torch.nn.Module):
    def forward(self, x, mask):
        return torch.ones(torch.sym_max(x[mask].shape[0], 2))


def test_a_symbolic_helper_feeding_computation_is_refused_by_name():
    args = torch.randn(6), torch.tensor([True, False, True, True, False, False])
    with pytest.raises(compiler.CompileError, match="torch.sym_max") as caught:
        compiler.compile(HelperSizesATensor(), args, "portable")
    assert caught.value.stage == "decompose" and caught.value.nodes
