"""Helpers for test_node_decompositions: the program a compile decomposes, and a node-by-node
comparison of the two decomposition paths."""

import torch
from torch.utils import _pytree as pytree

import compiler
from compiler.passes import decomposition as decompose_module
from compiler.passes import node_decompositions


class _Captured(Exception):
    pass


def program_to_decompose(model, inputs, backend: str):
    """(the ATen program, the names kept whole) the first decomposition of a compile gets."""
    seen = []
    original = decompose_module.decompose

    def spy(program, keep_nodes, by_node=True, fallbacks=None):
        seen.append((program, frozenset(keep_nodes)))
        raise _Captured

    decompose_module.decompose = spy
    try:
        compiler.compile(model, inputs, backend=backend)
    except Exception:  # the compile wraps the stop in a stage failure
        if not seen:
            raise
    finally:
        decompose_module.decompose = original
    assert seen, "no decomposition was made"
    return seen[0]


def _sources(node_sources) -> list:
    return [(s.name, s.pass_name, str(s.action), _sources(s.from_node)) for s in node_sources or []]


def _value(value):
    if isinstance(value, torch.Tensor):
        if not isinstance(value, torch._subclasses.FakeTensor):
            return "a real tensor"
        return (value.dtype, tuple(value.shape), tuple(value.stride()), value.storage_offset(), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return tuple(_value(v) for v in value)
    return repr(value)


def _storages(value) -> list:
    return [v.untyped_storage()._cdata if isinstance(v, torch.Tensor) else None for v in pytree.tree_leaves(value)]


def _aliases(node) -> list:
    """For each tensor of the node's value, which of its inputs' tensors share its storage (a view's)."""
    inputs = [s for n in node.all_input_nodes for s in _storages(n.meta.get("val"))]
    return [[i for i, s in enumerate(inputs) if s is not None and s == own] for own in _storages(node.meta.get("val"))]


def _arg(value):
    return torch.fx.node.map_arg(value, lambda n: ("node", n.name))


META = ("stack_trace", "nn_module_stack", "torch_fn", "original_aten")


def describe(program) -> list:
    rows = []
    for node in program.graph.nodes:
        row = [node.op, node.name, str(node.target), _arg(node.args), _arg(node.kwargs), _value(node.meta.get("val"))]
        if node.op == "call_function":
            row.append(_aliases(node))
            row.append(tuple(repr(node.meta.get(k)) for k in META))
            row.append(_sources(node.meta.get("from_node")))
            tm = node.meta.get("tensor_meta")
            row.append(None if tm is None else repr(tm))
        row.append(sorted(node.meta))
        if "eager_input_vals" in node.meta:
            row.append(repr(pytree.tree_map(_value, node.meta["eager_input_vals"])))
        if node.op == "output":
            row.append(_sources(node.meta.get("from_node")))
        if node.op == "placeholder":
            row.append(tuple(repr(node.meta.get(k)) for k in ("torch_fn", "tensor_meta", "desc")))
            row.append(_sources(node.meta.get("from_node")))
        rows.append(row)
    return rows


def both_paths(program, keep_nodes):
    """(torch's decomposition, ours) of `program`; fails if ours fell back."""
    reference, kept_ref = decompose_module.decompose(program, keep_nodes, by_node=False)
    taken = []
    original = node_decompositions._decompose_by_node

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        taken.append(result is not None)
        return result

    node_decompositions._decompose_by_node = spy
    try:
        ours, kept = decompose_module.decompose(program, keep_nodes)
    finally:
        node_decompositions._decompose_by_node = original
    assert taken == [True], f"the node-by-node path was not taken: {node_decompositions.why_ineligible(program)}"
    assert kept == kept_ref
    return reference, ours


def assert_same(reference, ours, inputs=None):
    expected, got = describe(reference), describe(ours)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert a == b, f"node {i} differs:\n torch: {a}\n ours:  {b}"
    assert len(expected) == len(got)
    assert str(reference.graph_signature) == str(ours.graph_signature), (str(reference.graph_signature), str(ours.graph_signature))
    assert reference.graph_signature == ours.graph_signature
    assert [str(e) for e in reference.module_call_graph] == [str(e) for e in ours.module_call_graph]
    assert reference.constants.keys() == ours.constants.keys()
    assert reference.state_dict.keys() == ours.state_dict.keys()
    if inputs is not None:
        with torch.no_grad():
            want = pytree.tree_leaves(reference.module()(*inputs))
            have = pytree.tree_leaves(ours.module()(*inputs))
        assert len(want) == len(have)
        for w, h in zip(want, have):
            assert torch.equal(w, h) or (w.is_floating_point() and torch.allclose(w, h, equal_nan=True, rtol=0, atol=0))
