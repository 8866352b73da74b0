"""Decomposition node by node: torch's `run_decompositions` without retracing the whole program.

`ExportedProgram.run_decompositions` retraces every node of the program (functionalization,
then a fake-tensor trace of each op); a 48-layer transformer holds 48 copies of each block,
and the retrace was most of an MLX compile (4.6 s of 7.6 s at depth 48). Here each *distinct*
node (its op, its literal arguments, where each tensor argument goes, and each tensor
argument's dtype, shape, strides and storage offset) is decomposed once, by torch's own
`run_decompositions` on a program holding that node alone (all distinct nodes of a program
in one such call, each with inputs of its own), and the result is spliced in place of every
copy. The decomposition is torch's, so it is the same ops; what the splice must rebuild as
the retrace does, it does:

- nodes are made in the retrace's order and named as it names them (a multi-result op makes
  a `getitem` for each result, the unused ones removed with the dead code at the end, so
  later names count them as the retrace's do);
- values are computed afresh on the program's fake mode from the new inputs (a node kept
  whole is traced by its no-decompose twin's meta kernel, which may choose other strides,
  and every node after it follows them), `tensor_meta` for single tensors; a step whose op
  gives a value of its own (no view) is dispatched once per recipe, and each copy gets a
  fresh value of that form, as the fake mode's dispatch cache makes one (`_forms`): half of
  a deep stack's splice was the kept ops' fake kernels, which that cache passes by;
- each node made from an original node carries that node's `stack_trace`, `nn_module_stack`,
  `torch_fn`, and its `from_node` (the original node's name, as the retrace records it),
  and `original_aten` as the retrace sets it (the op dispatched, which partitioners read);
- placeholders carry what the retrace gives them (descriptor; a parameter's or buffer's
  `from_node` and `torch_fn` from the last op reading it), the output its `from_node`, a node
  that needs exact strides its `eager_input_vals`; the retrace's input names (a constant
  `_folded_constant_0` becomes `c__folded_constant_0`, a constant's `persistent` None);
- dead code is removed, the output signature renamed, the module call graph updated.

What each distinct node decomposes into is remembered for the process (`_RECIPES`), keyed also
by the decomposition table (it differs with what a backend keeps whole) and the decompositions'
own switches (integer `remainder`): the dry run and the decompose stage, each compile of the
same widths, and each backend with the same table decompose a node once. The distinct nodes a
program needs are decomposed in one per-node program (each such program costs torch a fixed
tenth of a second): the layouts a node's inputs will have once decomposed are predicted by
each op's meta kernel, so the nodes after a kept op that changes strides are in it too.

Only programs where that is the same take this path (`why_ineligible`); every other program
goes through torch's `run_decompositions`, exactly as before: a mutation (of a buffer, a
parameter or an input, or any mutable or in-place op), a higher-order op (control flow,
wrappers) or any node that is not a call of an ATen-style op, a symbolic size anywhere, a
value that is not a tensor or a list of tensors (but for `_assert_tensor_metadata`, a check the
retrace keeps as it is), a non-tensor input, an output that is an input or given twice, a
non-persistent buffer or inputs out of the retrace's order (it would reorder them), an input
name the retrace would change other than a parameter's, buffer's or constant's prefix
(`c__folded_constant_0`). A decomposition the per-node program cannot reproduce exactly (it
raises, makes a constant, reads another node's input) also falls back, as does any error of
this path. `tests/stages/test_node_decompositions.py` compares both paths node by node (names,
targets, arguments, values, metadata, signature) and by running them, on transformer stacks,
CNNs with batch norm, attention with masks, views and slices, the test suite's models and
transformers' GPT-2 and Qwen3.
"""

from __future__ import annotations

import collections
import functools
import logging
import operator
import re
import types
from typing import Any, Mapping

import torch
from torch._functorch._aot_autograd.descriptors import BufferAOTInput, ParamAOTInput, PlainAOTInput
from torch._export.utils import _rename_without_collisions, placeholder_prefixes
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager, unset_fake_temporarily
from torch.export import ExportedProgram
from torch.export.exported_program import (
    ModuleCallEntry,
    ModuleCallSignature,
    _decompose_exported_program,
    _get_updated_module_call_graph,
    _split_decomp_table_to_cia_and_python_decomp,
)
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)
from torch.fx.experimental.proxy_tensor import extract_val
from torch.fx.experimental.symbolic_shapes import ShapeEnv, has_free_symbols
from torch.fx.proxy import _COPY_META_FIELDS
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.fx.traceback import NodeSource, NodeSourceAction
from torch.utils import _pytree as pytree

from compiler.ir.private_api import no_decompose_original

logger = logging.getLogger(__name__)

# Ops that only check (no result), which the retrace keeps as they are.
_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)
_INPUT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR, InputKind.USER_INPUT)
# What an original node lends each node made from it, as the retrace does (fx copies these
# fields of the node being traced onto each node it makes; `from_node` and `original_aten`
# are set apart).
_CARRIED = ("stack_trace",) + tuple(
    f for f in _COPY_META_FIELDS if f not in ("from_node", "original_aten")
)


# --- eligibility ----------------------------------------------------------------------------


def _plain_value(value) -> bool:
    if isinstance(value, torch.Tensor):
        return not has_free_symbols(value)
    if isinstance(value, (tuple, list)):
        return len(value) > 0 and all(isinstance(v, torch.Tensor) and not has_free_symbols(v) for v in value)
    return False


def _literal_ok(value) -> bool:
    """Whether a non-node argument is a plain literal (no symbolic number, no tensor)."""
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor)):
            return False
    return True


def why_ineligible(program: ExportedProgram) -> str | None:
    """Why `program` must be decomposed by torch's whole-program retrace, or None."""
    signature = program.graph_signature
    if signature.backward_signature is not None:
        return "a joint (training) graph"
    if signature.buffers_to_mutate or signature.user_inputs_to_mutate or getattr(signature, "parameters_to_mutate", None):
        return "it mutates a buffer, parameter or input"
    if any(spec.kind not in _INPUT_KINDS or not isinstance(spec.arg, TensorArgument) for spec in signature.input_specs):
        return "an input that is not a tensor (a number, a custom object or a token)"
    if any(spec.kind != OutputKind.USER_OUTPUT or not isinstance(spec.arg, TensorArgument) for spec in signature.output_specs):
        return "an output that is not a plain tensor result"
    if signature.non_persistent_buffers:
        return "a non-persistent buffer (the retrace moves it among the inputs)"
    kinds = [spec.kind for spec in signature.input_specs]
    if kinds != sorted(kinds, key=_INPUT_KINDS.index):
        return "inputs not in the retrace's order (parameters, buffers, constants, user inputs)"
    if program.range_constraints:
        return "symbolic sizes"
    graph = program.graph
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            return f"{node.name} calls the higher-order op {node.target.name()} (control flow or a wrapper)"
    for node in graph.nodes:
        if node.op == "placeholder":
            if not isinstance(node.meta.get("val"), torch.Tensor) or has_free_symbols(node.meta["val"]):
                return f"input {node.name} is not a tensor of static size"
            continue
        if node.op == "output":
            outputs = pytree.tree_leaves(node.args[0])
            if not all(isinstance(o, torch.fx.Node) and o.op == "call_function" for o in outputs):
                return "an output that is an input or a literal"
            if len(set(outputs)) != len(outputs):
                return "the same output twice"
            continue
        if node.op != "call_function":
            return f"{node.op} node {node.name}"
        target = node.target
        if target is operator.getitem:
            source, index = node.args
            if not isinstance(source, torch.fx.Node) or not isinstance(index, int) or node.kwargs:
                return f"getitem {node.name} of an unknown form"
            if not isinstance(source.meta.get("val"), (tuple, list)):
                return f"getitem {node.name} of a single value"
            if not isinstance(node.meta.get("val"), torch.Tensor):
                return f"getitem {node.name} is not a tensor"
            continue
        if not isinstance(target, torch._ops.OpOverload):
            return f"{node.name} calls {target}, not an ATen-style op (a higher-order op or a Python function)"
        if target._schema.is_mutable:
            return f"{node.name} calls the mutable op {target}"
        value = node.meta.get("val")
        if target in _CHECKS and value is None and not node.users:
            pass
        elif not _plain_value(value):
            return f"{node.name}'s value is not a tensor or a tuple of tensors of static size"
        if isinstance(value, (tuple, list)) and any(u.target is not operator.getitem for u in node.users):
            return f"{node.name}'s results are used other than one by one"
        for arg in pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(arg, torch.fx.Node):
                if not isinstance(arg.meta.get("val"), torch.Tensor):
                    return f"{node.name} reads {arg.name}, which is not a tensor"
            elif not _literal_ok(arg):
                return f"{node.name} takes a symbolic number or a tensor literal"
    return None


# --- the key of a distinct node -------------------------------------------------------------


def _literal_key(value):
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_literal_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _literal_key(v)) for k, v in value.items()))
    return (type(value).__name__, repr(value))


def _tensor_key(value: torch.Tensor) -> tuple:
    return (value.dtype, tuple(value.shape), tuple(value.stride()), value.storage_offset(), str(value.device))


_TABLES: dict[frozenset, int] = {}


def _stable(value, depth: int = 0):
    """What a table entry computes, the same for the same entry made again: ExecuTorch's table
    is made afresh each time, its CompositeImplicit entries new partials of a local function
    that captures nothing (one that captures something is taken as itself)."""
    if depth > 4:
        return ("id", id(value))
    if isinstance(value, functools.partial):
        return (
            "partial",
            _stable(value.func, depth + 1),
            tuple(_stable(a, depth + 1) for a in value.args),
            tuple((k, _stable(v, depth + 1)) for k, v in sorted(value.keywords.items())),
        )
    if isinstance(value, types.FunctionType):
        if value.__code__.co_freevars:  # a closure: what it captured is not looked into
            return ("id", id(value))
        return ("function", value.__code__, _stable(value.__defaults__, depth + 1))
    if isinstance(value, tuple):
        return tuple(_stable(v, depth + 1) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def _context(table: Mapping) -> tuple:
    """What, besides the node, decides what it decomposes into: the table (which differs with
    what a backend keeps whole), the decompositions' own switches (integer `remainder`) and
    torch's default dtype (a factory op's decomposition may read it)."""
    from compiler.ir import kernel_fixes

    entries = frozenset((op, _stable(decomposition)) for op, decomposition in table.items())
    number = _TABLES.setdefault(entries, len(_TABLES))
    return number, kernel_fixes.on("integer_remainder"), torch.get_default_dtype()


def _node_key(context: tuple, target, args, kwargs, vals: dict) -> tuple:
    """The op, its arguments with each node by its position among the node's inputs, and
    each input's tensor form: what decides what the node decomposes into."""
    order: dict[torch.fx.Node, int] = {}

    def describe(value):
        if isinstance(value, torch.fx.Node):
            order.setdefault(value, len(order))
            return ("input", order[value])
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(describe(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple((k, describe(v)) for k, v in value.items()))
        return _literal_key(value)

    described = (describe(args), describe(kwargs))
    inputs = list(order)
    return (context, target, described, tuple(_tensor_key(vals[n]) for n in inputs)), inputs


# --- the per-node programs ------------------------------------------------------------------


class _Recipe:
    """What one distinct node decomposes into: steps (target, args, kwargs, original_aten),
    their arguments referring to ("input", i) or ("step", j); and its results, by index. And
    the form of each step's value once the fake mode has made it (`_forms`): the same step
    on inputs of the same layouts has a value of the same form."""

    def __init__(self, steps: list, results: list):
        self.steps = steps
        self.results = results
        self.forms: list = [_NOT_YET] * len(steps)


_NOT_YET = object()


_RECIPES: dict[tuple, _Recipe] = {}
# A process compiling model after model keeps the newest recipes only (each is a few small
# tuples; a transformer block needs about twenty).
_MAX_RECIPES = 20_000
# The table split as `run_decompositions` splits it (CompositeImplicit ops apart), per context:
# splitting walks every op torch registers, a tenth of a second per per-node program.
_SPLITS: dict[tuple, tuple[dict, dict]] = {}


def forget_recipes() -> None:
    """Forget every node's decomposition, as a fresh process has none (benchmarks time a
    compile from there)."""
    _RECIPES.clear()
    _SPLITS.clear()


def _run_decompositions(program: ExportedProgram, table: Mapping, context: tuple) -> ExportedProgram:
    """`program.run_decompositions(table)`, with the table's split made once per context."""
    if context not in _SPLITS:
        _SPLITS[context] = _split_decomp_table_to_cia_and_python_decomp(dict(table))
    cia_to_decomp, python_decomp_table = _SPLITS[context]
    return _decompose_exported_program(
        program,
        cia_to_decomp=dict(cia_to_decomp),
        python_decomp_table=dict(python_decomp_table),
        joint_loss_index=None,
        decompose_custom_triton_ops=False,
    )


def _fake_like(mode: FakeTensorMode, value: torch.Tensor) -> torch.Tensor:
    with mode:
        if value.storage_offset() == 0:
            return torch.empty_strided(tuple(value.shape), value.stride(), dtype=value.dtype, device=value.device)
        size = value.storage_offset() + sum((s - 1) * st for s, st in zip(value.shape, value.stride()) if s > 0) + 1
        base = torch.empty(size, dtype=value.dtype, device=value.device)
        return base.as_strided(tuple(value.shape), value.stride(), value.storage_offset())


def _recipes_for(pending: dict[tuple, tuple], table: Mapping, context: tuple) -> None:
    """Decompose each distinct node in `pending` (key -> (target, args, kwargs, inputs, vals)) by
    torch's `run_decompositions` on one program holding each alone, with inputs of its own,
    and record its recipe."""
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    graph = torch.fx.Graph()
    placeholders: dict[tuple, list] = {}
    made: dict[tuple, list] = {}
    for number, (key, (target, args, kwargs, inputs, vals)) in enumerate(pending.items()):
        phs = []
        for i, source in enumerate(inputs):
            ph = graph.placeholder(f"nd{number}_in{i}")
            ph.meta["val"] = _fake_like(mode, vals[source])
            phs.append(ph)
        placeholders[key] = phs
    outputs = []
    for number, (key, (target, args, kwargs, inputs, vals)) in enumerate(pending.items()):
        env = dict(zip(inputs, placeholders[key]))
        new_args, new_kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: env[n])
        node = graph.create_node("call_function", target, tuple(new_args), dict(new_kwargs), name=f"nd{number}_op")
        fake_args, fake_kwargs = torch.fx.node.map_arg((new_args, new_kwargs), lambda n: n.meta["val"])
        with mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        if node.meta["val"] is None:
            results = []
        elif isinstance(node.meta["val"], (tuple, list)):
            results = []
            for i, v in enumerate(node.meta["val"]):
                item = graph.call_function(operator.getitem, (node, i))
                item.meta["val"] = v
                results.append(item)
        else:
            results = [node]
        made[key] = results
        outputs.extend(results)
    graph.output(tuple(outputs))
    gm = torch.fx.GraphModule({}, graph)
    all_placeholders = [ph for phs in placeholders.values() for ph in phs]
    signature = ExportGraphSignature(
        input_specs=[InputSpec(InputKind.USER_INPUT, TensorArgument(ph.name), None) for ph in all_placeholders],
        output_specs=[OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(o.name), None) for o in outputs],
    )
    in_spec = pytree.tree_flatten((tuple(range(len(all_placeholders))), {}))[1]
    out_spec = pytree.tree_flatten(tuple(range(len(outputs))))[1]
    call_graph = [
        ModuleCallEntry(
            "",
            ModuleCallSignature(
                inputs=[],
                outputs=[],
                in_spec=in_spec,
                out_spec=out_spec,
            ),
        )
    ]
    tiny = ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict={},
        range_constraints={},
        module_call_graph=call_graph,
        example_inputs=None,
        constants={},
    )
    decomposed = _run_decompositions(tiny, table, context)
    # Map the decomposed program back: placeholders in order, then each output to its node.
    # Only the inputs given: a decomposition that made a constant (lifted into the signature)
    # is one this path does not splice.
    if [spec.kind for spec in decomposed.graph_signature.input_specs] != [InputKind.USER_INPUT] * len(all_placeholders):
        raise _NotExact("a decomposition made an input of its own (a lifted constant)")
    if decomposed.constants or decomposed.state_dict:
        raise _NotExact("a decomposition made a constant")
    new_placeholders = [n for n in decomposed.graph.nodes if n.op == "placeholder"]
    ph_iter = iter(new_placeholders)
    owner_inputs: dict[torch.fx.Node, tuple] = {}
    for key, phs in placeholders.items():
        for i, _ in enumerate(phs):
            owner_inputs[next(ph_iter)] = (key, i)
    new_outputs = list(decomposed.graph.output_node().args[0])
    # Which key each result belongs to.
    position = 0
    result_keys = []
    for key, results in made.items():
        result_keys.append((key, new_outputs[position : position + len(results)]))
        position += len(results)
    # Each node of the decomposed program belongs to the node it was traced from (its
    # `from_node`), side-effect nodes with no result included (`_assert_tensor_metadata`).
    owners = {f"nd{number}_op": key for number, key in enumerate(pending)}
    belongs: dict[tuple, list] = {key: [] for key in pending}
    for node in decomposed.graph.nodes:
        if node.op != "call_function":
            continue
        sources = node.meta.get("from_node") or []
        owner = owners.get(sources[-1].name) if sources else None
        if owner is None:
            raise _NotExact(f"a decomposed node {node.name} of no known origin")
        belongs[owner].append(node)
    for key, results in result_keys:
        steps: list = []
        index: dict[torch.fx.Node, tuple] = {}
        for node in belongs[key]:
            for source in node.all_input_nodes:
                if source.op == "placeholder" and source not in index:
                    owner, i = owner_inputs[source]
                    if owner != key:
                        raise _NotExact(f"the decomposition of {key[1]} reads another node's input")
                    index[source] = ("input", i)
                elif source not in index:
                    raise _NotExact(f"the decomposition of {key[1]} reads another node's result")
            ref_args, ref_kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _Ref(index[n]))
            steps.append(
                (
                    node.target,
                    ref_args,
                    ref_kwargs,
                    node.meta.get("original_aten"),
                    node.meta.get("seq_nr"),
                    "eager_input_vals" in node.meta,
                )
            )
            index[node] = ("step", len(steps) - 1)
        for r in results:
            if r not in index:
                if r.op != "placeholder" or owner_inputs[r][0] != key:
                    raise _NotExact(f"a result of {key[1]} comes from elsewhere")
                index[r] = ("input", owner_inputs[r][1])
        _RECIPES[key] = _Recipe(steps, [index[r] for r in results])
        while len(_RECIPES) > _MAX_RECIPES:
            del _RECIPES[next(iter(_RECIPES))]


class _NotExact(Exception):
    pass


class _Ref:
    """A reference, in a recipe's arguments, to an input or an earlier step."""

    __slots__ = ("ref",)

    def __init__(self, ref):
        self.ref = ref


# --- the splice ---------------------------------------------------------------------------


def _source(name: str, target: str, pass_name: str, action, inner: list) -> NodeSource:
    source = NodeSource(None, pass_name, action)
    source.node_info = NodeSource.NodeInfo(name, target, 0)
    source.from_node = inner
    return source


def _module_copy(node: torch.fx.Node) -> NodeSource:
    """`node` as copied into the unlifted module the retrace traces (`ExportedProgram.module()`)."""
    return NodeSource(node, "ExportedProgram.module()", NodeSourceAction.CREATE)


def _unlifted_from_node(node: torch.fx.Node) -> list:
    """The `from_node` of a node the unlifting replaced in the module the retrace traces (its
    output, a parameter no op reads): made by `unlift()` from the module's copy of `node`."""
    copied = _module_copy(node)
    return [
        _source(
            copied.name,
            copied.target,
            "ExportedProgram.module().unlift()",
            [NodeSourceAction.CREATE, NodeSourceAction.REPLACE],
            [copied],
        )
    ]


def _placeholder_meta(node: torch.fx.Node, spec: InputSpec, user_index: int) -> dict:
    """A placeholder's metadata as the retrace gives it: its value and tensor_meta, its
    descriptor, and for a parameter or buffer what `_collect_param_buffer_metadata` copies
    from the last op reading it (or, read by none, the unlifting's `from_node`)."""
    value = node.meta["val"]
    meta = {"val": value, "tensor_meta": node.meta.get("tensor_meta") or _extract_tensor_metadata(value)}
    if spec.kind == InputKind.USER_INPUT:
        meta["desc"] = PlainAOTInput(user_index)
        return meta
    if spec.kind == InputKind.PARAMETER:
        meta["desc"] = ParamAOTInput(spec.target)
    else:
        meta["desc"] = BufferAOTInput(spec.target)
        if spec.kind == InputKind.CONSTANT_TENSOR:
            return meta
    users = [u for u in node.users if u.op == "call_function"]
    if not users:
        meta["from_node"] = _unlifted_from_node(node)
        return meta
    for user in sorted(users, key=_position(node.graph)):
        for field in _COPY_META_FIELDS:
            if field == "from_node":
                meta[field] = [_module_copy(user)]
            elif field in user.meta and field not in ("custom", "nn_module_stack"):
                meta[field] = user.meta[field]
    return meta


def _position(graph: torch.fx.Graph):
    """A sort key of a graph's nodes by their place in it (computed once per graph)."""
    cached = getattr(graph, "_node_decompositions_order", None)
    if cached is None or len(cached) != len(graph.nodes):
        cached = {n: i for i, n in enumerate(graph.nodes)}
        graph._node_decompositions_order = cached
    return cached.__getitem__


def _carried_from_node(original: torch.fx.Node) -> list:
    """The `from_node` the retrace gives each node made from `original`: it was traced from the
    unlifted module's copy of `original` (pass "ExportedProgram.module()"), by an interpreter
    (pass "Interpreter_PropagateUnbackedSymInts")."""
    module_copy = NodeSource(original, "ExportedProgram.module()", NodeSourceAction.CREATE)
    interpreted = NodeSource(None, "Interpreter_PropagateUnbackedSymInts", NodeSourceAction.CREATE)
    interpreted.node_info = NodeSource.NodeInfo(original.name, module_copy.target, module_copy.graph_id)
    interpreted.from_node = [module_copy]
    return [interpreted]


def _substitute(value, env):
    if isinstance(value, _Ref):
        return env[value.ref]
    if isinstance(value, tuple):
        return tuple(_substitute(v, env) for v in value)
    if isinstance(value, list):
        return [_substitute(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _substitute(v, env) for k, v in value.items()}
    return value


def decompose_by_node(program: ExportedProgram, table: Mapping, fallbacks: list[str] | None = None) -> ExportedProgram | None:
    """`program.run_decompositions(table)`, made node by node; None when `program` is not one
    this path takes (the caller then runs torch's). A failure this path did not foresee is
    handled the same way, said in one line in `fallbacks` (the stage's row), its traceback
    only in the debug log."""
    why = why_ineligible(program)
    if why:
        logger.debug("decomposing by torch's retrace: %s", why)
        return None
    try:
        return _decompose_by_node(program, table)
    except _NotExact as exc:
        logger.debug("decomposing by torch's retrace: %s", exc)
        return None
    except Exception as exc:  # a form this path did not foresee: torch's retrace, as before
        logger.debug("decomposing node by node failed; decomposing by torch's retrace", exc_info=True)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if fallbacks is not None:
            fallbacks.append(f"{type(exc).__name__}: {first}"[:200])
        return None


def _decompose_by_node(program: ExportedProgram, table: Mapping) -> ExportedProgram | None:
    from compiler.passes.edge_conversion import fake_mode

    mode = fake_mode(program.graph_module)
    if mode is None:
        raise _NotExact("no fake mode")
    old_nodes = list(program.graph.nodes)

    # First pass: the values each node would have in the decomposed program depend on the
    # decomposition only through its inputs' layouts; collect the distinct nodes in order,
    # decomposing in rounds as new layouts appear.
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, Any] = {}  # old node -> new node, or list of new nodes for multi-results
    vals: dict[torch.fx.Node, torch.Tensor] = {}  # old node -> its new value (tensors only)
    specs = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    user_inputs = 0
    for node in old_nodes:
        if node.op != "placeholder":
            continue
        new = graph.placeholder(node.name)
        new.meta = _placeholder_meta(node, specs[node.name], user_inputs)
        user_inputs += specs[node.name].kind == InputKind.USER_INPUT
        env[node] = new
        vals[node] = node.meta["val"]

    calls = [n for n in old_nodes if n.op == "call_function"]
    context = _context(table)
    _first_recipes(old_nodes, calls, context, table, mode)
    for node in calls:
        if node.target is operator.getitem:
            env[node] = env[node.args[0]][node.args[1]]
            vals[node] = env[node].meta["val"]
            continue
        key, inputs = _node_key(context, node.target, node.args, node.kwargs, vals)
        if key not in _RECIPES:
            _make_recipes({key: (node.target, node.args, node.kwargs, inputs, vals)}, table, context)
        _splice(graph, node, key, inputs, env, vals, mode)

    old_names = {env[n]: n.name for n in old_nodes if n.op == "placeholder"}
    old_output = program.graph.output_node()
    outputs = torch.fx.node.map_arg(old_output.args[0], lambda n: env[n])
    output = graph.output(outputs)
    output.meta["from_node"] = _unlifted_from_node(old_output)
    graph.eliminate_dead_code()
    gm = torch.fx.GraphModule({}, graph)
    gm.meta.update(program.graph_module.meta)

    new_outputs = pytree.tree_leaves(outputs)
    if len(set(new_outputs)) != len(new_outputs) or any(o.op != "call_function" for o in new_outputs):
        raise _NotExact("an output became an input or another output")
    old_signature = program.graph_signature
    if len(new_outputs) != len(old_signature.output_specs):
        raise _NotExact("outputs do not match the signature")
    names = _placeholder_names(old_signature)
    for node in graph.nodes:
        # By the old placeholder's name: a new graph renames one named like a builtin (a
        # Sequential's `input` becomes `input_1`), which the signature does not know.
        wanted = names[old_names[node]] if node.op == "placeholder" else node.name
        if wanted != node.name:
            node.name = node.target = wanted
            if node.name != wanted:
                raise _NotExact("a placeholder could not take its name")
    signature = ExportGraphSignature(
        input_specs=[
            # As the retrace writes them: only a buffer says whether it persists.
            InputSpec(
                spec.kind,
                TensorArgument(names[spec.arg.name]),
                spec.target,
                spec.persistent if spec.kind == InputKind.BUFFER else None,
            )
            for spec in old_signature.input_specs
        ],
        output_specs=[
            OutputSpec(spec.kind, TensorArgument(new.name), spec.target)
            for spec, new in zip(old_signature.output_specs, new_outputs)
        ],
    )
    # Placeholder names unchanged; op names must not have collided with them.
    placeholder_names = {n.name for n in graph.nodes if n.op == "placeholder"}
    if any(n.op != "placeholder" and n.name in placeholder_names for n in graph.nodes):
        raise _NotExact("a name collision")
    call_graph = _get_updated_module_call_graph(
        program.graph_module, old_signature, gm, signature, program.module_call_graph
    )
    return ExportedProgram(
        root=gm,
        graph=gm.graph,
        graph_signature=signature,
        state_dict=dict(program.state_dict),  # as the retrace: the input's dicts stay its own
        range_constraints=program.range_constraints,
        module_call_graph=call_graph,
        example_inputs=program.example_inputs,
        constants=dict(program.constants),
    )


def _first_recipes(old_nodes: list, calls: list, context: tuple, table: Mapping, mode: FakeTensorMode) -> None:
    """Decompose, in one per-node program, the distinct nodes as the program's values give
    them and as they will likely be once decomposed. A node's inputs change layout where a node
    before it is kept whole and its meta kernel chooses other strides than the capture did
    (attention's output), and every node after it follows; each node's value is predicted by
    its op's meta kernel (which a decomposition matches but for such choices). A node the
    prediction missed is decomposed on its own as the splice meets it; a predicted node torch
    cannot decompose alone costs only the prediction (the nodes of the program's own values
    are then decomposed without it)."""
    original = {n: n.meta["val"] for n in old_nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    predicted = dict(original)
    results_of: dict[tuple, Any] = {}
    pending: dict[tuple, tuple] = {}
    likely: dict[tuple, tuple] = {}
    for node in calls:
        if node.target is operator.getitem:
            results = predicted.get(node.args[0])
            if isinstance(results, (tuple, list)) and isinstance(results[node.args[1]], torch.Tensor):
                predicted[node] = results[node.args[1]]
            continue
        key, inputs = _node_key(context, node.target, node.args, node.kwargs, original)
        if key not in _RECIPES:
            pending.setdefault(key, (node.target, node.args, node.kwargs, inputs, original))
        key, inputs = _node_key(context, node.target, node.args, node.kwargs, predicted)
        if key not in _RECIPES and key not in pending:
            likely.setdefault(key, (node.target, node.args, node.kwargs, inputs, predicted))
        if key not in results_of:
            results_of[key] = _meta_value(node, predicted, mode)
        if results_of[key] is not None:
            predicted[node] = results_of[key]
    if likely:
        try:
            _make_recipes(pending | likely, table, context)
            return
        except _NotExact as exc:
            logger.debug("the predicted layouts could not all be decomposed alone: %s", exc)
    _make_recipes(pending, table, context)


def _meta_value(node: torch.fx.Node, values: dict, mode: FakeTensorMode):
    """`node`'s value by its op's meta kernel on `values` (None where it cannot tell)."""
    try:
        with mode, torch.no_grad():
            args, kwargs = torch.fx.node.map_arg(
                (node.args, node.kwargs), lambda n: values[n].detach() if n in values else _inference_value(n)
            )
            return node.target(*args, **kwargs)
    except Exception:  # only a prediction: the splice computes the value again
        return None


def _make_recipes(pending: dict, table: Mapping, context: tuple) -> None:
    if not pending:
        return
    try:
        with unset_fake_temporarily():
            _recipes_for(pending, table, context)
    except _NotExact:
        raise
    except Exception as exc:  # torch could not decompose the node alone: the whole program then
        raise _NotExact(f"decomposing a node alone failed: {exc}") from exc


def _inference_value(node: torch.fx.Node):
    value = node.meta["val"]
    return value.detach() if isinstance(value, torch.Tensor) and value.requires_grad else value


def _placeholder_names(signature: ExportGraphSignature) -> dict[str, str]:
    """Old placeholder name -> the name the retrace gives it (torch's `placeholder_naming_pass`):
    a parameter, buffer or constant is named by its prefix and target (a constant the fold
    named `_folded_constant_0` becomes `c__folded_constant_0`); a user input keeps its name,
    which must already be the one the retrace gives it."""
    name_map: dict[str, str] = {}
    find_available: dict[str, int] = collections.defaultdict(int)
    used: set[str] = set()
    for spec in signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            name = spec.arg.name
            if re.sub(r"[^a-zA-Z0-9]", "_", name).lower() != name:
                raise _NotExact(f"the retrace would rename the input {name}")
            _rename_without_collisions(name_map, find_available, used, name, name, is_placeholder=True)
    for spec in signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            continue
        target = spec.target
        if target.startswith("L__self___"):
            target = target[len("L__self___") :]
        elif target.startswith("self_"):
            target = target[len("self_") :]
        base = re.sub(r"[^a-zA-Z0-9]", "_", re.sub(r"[^a-zA-Z0-9]", "_", target).lower())
        _rename_without_collisions(
            name_map, find_available, used, spec.arg.name, placeholder_prefixes[spec.kind] + base, is_placeholder=True
        )
    if len(set(name_map.values())) != len(name_map):
        raise _NotExact("placeholder names collide")
    return name_map


def _stamp(made: torch.fx.Node, carried: dict, from_node: list, original_aten, seq_nr) -> None:
    """What the retrace records on each node it makes for an original one (an op, its getitems)."""
    made.meta.update(carried)
    made.meta["from_node"] = from_node
    if original_aten is not None:
        made.meta["original_aten"] = original_aten
    if seq_nr is not None:
        made.meta["seq_nr"] = seq_nr


def _forms(target, value) -> tuple | None:
    """The form of each tensor of `value`, which the fake mode made for `target`, when its value
    is one of its own: what the fake mode's dispatch cache keeps to make such a value again
    (dtype, shape, strides). The retrace records a value of its own for every op whose schema
    says so (no view), even where the kernel returns its input (dropout in eval): its
    functionalization gives the output storage of its own. None for a view (the dispatcher
    records its base on it, which a value made apart would lack), an op the cache would not
    keep, or a value that is not plain tensors. A no-decompose twin (an op kept whole) is
    taken as its ATen op, whose meta kernel its fake kernel runs."""
    target = no_decompose_original(target) or target
    if not isinstance(target, torch._ops.OpOverload) or not torch._library.utils.is_builtin(target):
        return None
    if target.is_view or target._schema.is_mutable or target is torch.ops.aten._unsafe_view.default:
        return None
    if {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape, torch.Tag.inplace_view} & set(target.tags):
        return None
    single = isinstance(value, torch.Tensor)
    outputs = [value] if single else list(value) if isinstance(value, (tuple, list)) else []
    if not outputs or not all(type(v) is FakeTensor and v.layout == torch.strided for v in outputs):
        return None
    if any(has_free_symbols(v) or v.storage_offset() != 0 for v in outputs):
        return None
    forms = tuple(
        (tuple(v.shape), tuple(v.stride()), v.dtype, v.device, v.requires_grad, v.is_conj(), v.is_neg()) for v in outputs
    )
    return (None if single else type(value)), forms


def _value_of_form(forms: tuple, mode: FakeTensorMode):
    """A value of the forms `_forms` kept, made as the fake mode's dispatch cache makes one: an
    empty meta tensor of the form, in a fake tensor (of storage its own)."""
    container, tensors = forms
    values = []
    for shape, stride, dtype, device, requires_grad, conj, neg in tensors:
        with in_kernel_invocation_manager(mode):
            empty = torch.empty_strided(shape, stride, dtype=dtype, device="meta", requires_grad=requires_grad)
            if conj:
                torch._C._set_conj(empty, True)
            if neg:
                torch._C._set_neg(empty, True)
        values.append(FakeTensor(mode, empty, device))
    return values[0] if container is None else container(values)


def _splice(graph, node, key, inputs, env, vals, mode) -> None:
    """Make `node`'s recipe in `graph` on the new inputs, with values and metadata."""
    recipe = _RECIPES[key]
    refs: dict[tuple, Any] = {("input", i): env[source] for i, source in enumerate(inputs)}
    carried = {k: node.meta[k] for k in _CARRIED if k in node.meta}
    from_node = _carried_from_node(node)
    made_items: dict[tuple, list] = {}
    for j, (target, args, kwargs, original_aten, seq_nr, eager) in enumerate(recipe.steps):
        if target is operator.getitem:
            source_ref = args[0].ref
            items = made_items.get(source_ref)
            if items is None:
                raise _NotExact(f"a getitem of a single result in {node.name}'s decomposition")
            refs[("step", j)] = items[args[1]]
            continue
        new_args = _substitute(args, refs)
        new_kwargs = _substitute(kwargs, refs)
        # Named as make_fx names what it traces: by the op's packet.
        new = graph.create_node(
            "call_function", target, tuple(new_args), dict(new_kwargs), name=target.overloadpacket.__name__
        )
        forms = recipe.forms[j]
        if forms is _NOT_YET or forms is None:
            # The retrace runs in inference: no value requires grad (a view of a parameter would).
            fake_args, fake_kwargs = torch.fx.node.map_arg((new_args, new_kwargs), _inference_value)
            with mode, torch.no_grad():
                value = target(*fake_args, **fake_kwargs)
            if forms is _NOT_YET:
                forms = recipe.forms[j] = _forms(target, value)
        if forms is not None:
            value = _value_of_form(forms, mode)
        _stamp(new, carried, from_node, original_aten, seq_nr)
        if eager:
            # As make_fx records it for an op needing exact strides: its inputs' values.
            new.meta["eager_input_vals"] = torch.fx.node.map_aggregate(
                (new.args, new.kwargs),
                lambda a: extract_val(a.meta["val"]) if isinstance(a, torch.fx.Node) and "val" in a.meta else None,
            )
        if value is not None:  # a check has none, and the retrace records none
            new.meta["val"] = value
        if isinstance(value, torch.Tensor):
            new.meta["tensor_meta"] = _extract_tensor_metadata(value)
        elif isinstance(value, (tuple, list)):
            # The retrace makes a getitem for every result, right after the op.
            items = []
            for i, v in enumerate(value):
                item = graph.create_node("call_function", operator.getitem, (new, i), name="getitem")
                _stamp(item, carried, from_node, original_aten, seq_nr)
                item.meta["val"] = v
                if isinstance(v, torch.Tensor):
                    item.meta["tensor_meta"] = _extract_tensor_metadata(v)
                items.append(item)
            made_items[("step", j)] = items
        elif not (value is None and target in _CHECKS):
            raise _NotExact(f"{node.name}'s decomposition makes a {type(value).__name__}")
        refs[("step", j)] = new
    results = [refs[r] for r in recipe.results]
    if node.meta.get("val") is None:
        env[node] = None
    elif isinstance(node.meta["val"], (tuple, list)):
        env[node] = results
    else:
        env[node] = results[0]
        vals[node] = results[0].meta["val"]
