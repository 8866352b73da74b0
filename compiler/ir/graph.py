"""Small graph utilities shared by stages, verifiers and the report."""

from __future__ import annotations

import collections
import copy
import operator
from typing import Iterator

import torch
import torch._functorch.predispatch
from torch.export import ExportedProgram
from torch.utils import _pytree as pytree
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

from executorch.exir.delegate import executorch_call_delegate

DELEGATION_TAG = "delegation_tag"

CONSTANT_INPUT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


# functorch's transform markers in a pre-dispatch (ATen) graph: a vmap region opens and
# closes with them, and the values between are batched tensors.
TRANSFORM_MARKERS = frozenset(
    getattr(torch._functorch.predispatch, name)
    for name in (
        "_vmap_increment_nesting",
        "_vmap_decrement_nesting",
        "_jvp_increment_nesting",
        "_jvp_decrement_nesting",
        "_enter_dual_level",
        "_exit_dual_level",
        "lazy_load_decompositions",
    )
)


# In-place by schema, but they change no data (`x[torch.tensor([1])] = v` detaches its index).
METADATA_WRITES = frozenset([torch.ops.aten.detach_.default])


def written_arguments(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes an op writes into (training-IR programs keep in-place ops like add_, copy_)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or node.target in METADATA_WRITES:
        return []
    written = []
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)
        written += [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.fx.Node)]
    return written


def writes_argument(node: torch.fx.Node, target: torch.fx.Node) -> bool:
    """Whether `node` writes `target`'s data in place."""
    return target in written_arguments(node)


def written_buffers(ep: ExportedProgram) -> set[str]:
    """The buffers the program writes: mutations it returns, and in-place writes of a buffer's
    placeholder (a program as captured, before functionalization)."""
    buffers = ep.graph_signature.inputs_to_buffers
    written = set(ep.graph_signature.buffers_to_mutate.values())
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in buffers and any(writes_argument(u, node) for u in node.users):
            written.add(buffers[node.name])
    return written


def lift_constant(ep: ExportedProgram, name: str, value: torch.Tensor, fake_mode) -> torch.fx.Node:
    """A new lifted constant `name` holding `value`: its placeholder (before the user inputs,
    where the signature lists constants), its signature entry and its data."""
    specs = ep.graph_signature.input_specs
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    index = next((i for i, spec in enumerate(specs) if spec.kind == InputKind.USER_INPUT), len(specs))
    if index < len(specs):
        before = next(n for n in placeholders if n.name == specs[index].arg.name)
    else:
        before = placeholders[-1].next if placeholders else next(iter(ep.graph.nodes))
    ep.constants[name] = value
    with ep.graph.inserting_before(before):
        node = ep.graph.placeholder(name)
    node.meta["val"] = fake_mode.from_tensor(value, static_shapes=True)
    specs.insert(index, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(node.name), name, True))
    return node


def rename_output(ep: ExportedProgram, old: str, new: str) -> None:
    """The graph signature names outputs by node: follow a replaced output node."""
    for spec in ep.graph_signature.output_specs:
        if getattr(spec.arg, "name", None) == old:
            spec.arg.name = new


def call_nodes(ep: ExportedProgram) -> Iterator[torch.fx.Node]:
    return (n for n in ep.graph.nodes if n.op == "call_function")


def op_nodes(ep: ExportedProgram) -> Iterator[torch.fx.Node]:
    """Call nodes that do work: not tuple access, not a delegate call."""
    return (
        n
        for n in call_nodes(ep)
        if n.target is not operator.getitem and n.target is not executorch_call_delegate
    )


def delegate_calls(ep: ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in call_nodes(ep) if n.target is executorch_call_delegate]


def copy_program(ep: ExportedProgram) -> ExportedProgram:
    """A copy whose graph can be changed freely; tensor data and delegates stay shared.

    Stages that annotate or rewrite a graph work on such a copy so the artifact
    they were given stays valid, without paying for a copy of the weights. A
    delegate (lowered module) is never rewritten after the lower stage, and a copy
    of one builds its original program anew, which validates every op of it again
    (1.3 s of emit's 1.7 s on a depth-48 Core ML stack).

    FX's deep copy renames a node whose name is a Python builtin (nn.Sequential's
    user input `input` becomes `input_1`) while the graph signature keeps `input`;
    nodes are copied in order, so their names are put back pairwise.
    """
    delegates = [
        module
        for module in ep.graph_module.modules()
        if isinstance(getattr(module, "original_module", None), ExportedProgram)  # lowered delegates
    ]
    shared = {
        id(value): value
        for value in [*ep.state_dict.values(), *ep.constants.values(), *delegates]
    }
    copied = copy.deepcopy(ep, memo=shared)
    renamed = False
    for original, node in zip(ep.graph.nodes, copied.graph.nodes):
        if node.name != original.name:
            node.name = original.name
            if node.op == "placeholder":
                node.target = original.target
            renamed = True
    if renamed:
        copied.graph_module.recompile()
    return copied


def constant_placeholders(ep: ExportedProgram) -> dict[str, InputSpec]:
    """Placeholder name -> its input spec, for parameters, buffers and lifted constants."""
    return {
        spec.arg.name: spec
        for spec in ep.graph_signature.input_specs
        if spec.kind in CONSTANT_INPUT_KINDS
    }


def mutated_buffer_targets(ep: ExportedProgram) -> set[str]:
    return set(ep.graph_signature.buffers_to_mutate.values())


def drop_unread_constants(ep: ExportedProgram) -> int:
    """Parameters, buffers and lifted constants no node reads (an `_assert_tensor_metadata` of
    one does not count: it goes with it), removed with their data; a buffer the program writes
    is kept. Returns their bytes. ExecuTorch's emitter writes every constant the signature lists:
    TorchAO's codebook codes, read after the fold only by such an assert, went into the .pte
    beside the Core ML delegate's own copy."""
    specs = ep.graph_signature.input_specs
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    mutated = mutated_buffer_targets(ep)
    removed = 0
    for spec in list(specs):
        node = placeholders.get(spec.arg.name)
        if node is None or spec.kind == InputKind.USER_INPUT or spec.target in mutated:
            continue
        if any(user.target is not torch.ops.aten._assert_tensor_metadata.default for user in node.users):
            continue
        for assertion in list(node.users):
            ep.graph.erase_node(assertion)
        store = ep.state_dict if spec.target in ep.state_dict else ep.constants
        value = store.pop(spec.target, None)
        if isinstance(value, torch.Tensor):
            removed += value.numel() * value.element_size()
        specs.remove(spec)
        ep.graph.erase_node(node)
    return removed


def graph_text(ep: ExportedProgram) -> str:
    return ep.graph_module.print_readable(print_output=False, include_stride=False, include_device=False)


def state_not_starting_at_zero(ep: ExportedProgram) -> list[tuple[torch.fx.Node, str]]:
    """(placeholder, target) of each mutated buffer whose initial value is not all zeros:
    the state runtimes would silently start at zero unless told otherwise."""
    mutated = mutated_buffer_targets(ep)
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    found = []
    for spec in ep.graph_signature.input_specs:
        if spec.target not in mutated or spec.arg.name not in placeholders:
            continue
        value = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
        if isinstance(value, torch.Tensor) and bool(value.any()):
            found.append((placeholders[spec.arg.name], spec.target))
    return found


# The ops torch's `legalize_graph` (torch/fx/passes/tools_common.py) moves to the front of its
# queue: runtime assertions before the data-dependent ops they guard.
_PRIORITIZED_OPS = frozenset(
    [
        operator.add, operator.mul, operator.sub, operator.floordiv, operator.truediv, operator.mod,
        operator.le, operator.lt, operator.ge, operator.gt, operator.eq, operator.ne,
        torch.ops.aten.sym_constrain_range.default,
        torch.ops.aten.sym_constrain_range_for_size.default,
        torch.ops.aten._assert_async.msg,
        torch.ops.aten.scalar_tensor.default,
        torch.ops.aten._assert_scalar.default,
    ]
)


def legalized_order(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The order torch's `legalize_graph` puts `graph`'s nodes in: Kahn's topological sort,
    nodes with no inputs in graph order first, each node's users in the order of its `users`."""
    nodes = list(graph.nodes)
    waiting = dict.fromkeys(nodes, 0)
    for node in nodes:
        for user in node.users:
            waiting[user] += 1
    queue = collections.deque(node for node in nodes if waiting[node] == 0)
    order = []
    while queue:
        node = queue.popleft()
        order.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                if user.op == "call_function" and user.target in _PRIORITIZED_OPS:
                    queue.appendleft(user)
                else:
                    queue.append(user)
    if len(order) < len(nodes):
        raise RuntimeError(f"Input graph has cycles, unable to add {[n for n in waiting if waiting[n] != 0]}")
    return order


def legalize_in_place(graph_module: torch.fx.GraphModule) -> bool:
    """What torch's `legalize_graph(graph_module)` leaves, without copying the graph or
    regenerating the module's code: the nodes in its order and each node's users in the order
    of their place (a copied node's users are registered as its users are created). Returns
    False, changing nothing, where the copy would rename a node (a name FX reserves, such as
    `input`): the caller then calls `legalize_graph`. The module's code is stale until its
    next `recompile()` (an ExportedProgram built on it recompiles it)."""
    graph = graph_module.graph
    if any(node.name in torch.fx.graph._illegal_names for node in graph.nodes):
        return False
    order = legalized_order(graph)
    place = {node: number for number, node in enumerate(order)}
    previous = graph._root
    for node in order:
        if previous.next is not node:
            previous.append(node)
        previous = node
        users = node.users
        if len(users) > 1:
            ordered = sorted(users, key=place.__getitem__)
            if ordered != list(users):
                users.clear()
                users.update(dict.fromkeys(ordered))
    return True
