"""What stock XNNPACK 1.5.1 lowers wrongly, and the rewrite that keeps it off the delegate.

A torchao `dequantize_affine` of a weight is lowered right by the XNNPACK delegate
only as the weight of a GEMM whose activation is dynamically quantized (int8 per
token: XNNPACK's qd8 x qc8w / qb4w kernels). A weight-only quantized Linear
(torchao `IntxWeightOnlyConfig`) has a float activation: stock's `LinearConfig`
refuses it, so the linear decomposes to `permute_copy` + `addmm`, and then
`AddmmConfig.get_deps_from_src_partition` walks the weight argument back to the
source partition's input, past the `dequantize_affine`, to the raw int8 qdata: the
GEMM is taken as FP32 with the whole source partition, and `OpDequantizeAffine`
skips a per-channel-group dequantize on a weight as if a quantized GEMM would read
its scales. Nothing does: the delegate computes `x @ qdata.T + b` (stock
`to_edge_transform_and_lower(XnnpackPartitioner())` gives the same wrong numbers).

Such a `dequantize_affine` is rewritten into plain Edge ops (cast, subtract the
zero point, multiply by the scale, per block) before the partition search: the
weight stays int8 in the program, the casts run on the CPU's portable kernels
(which have no kernel for `torchao.dequantize_affine` itself), XNNPACK may take the
float sub and mul, and the GEMM reading a computed weight is left on the CPU by
stock's own rule (a float GEMM's weight must be static).

XNNPACK's GELU is the exact one whatever `approximate` says (its node visitor passes
no mode): `gelu(x, approximate="tanh")` (Gemma, SigLIP, GPT-2's `gelu_pytorch_tanh`)
comes out up to 4.7e-4 off, with no error (stock gives the same numbers). Each tanh
GELU is rewritten into the formula torch computes, 0.5 x (1 + tanh(sqrt(2/pi) (x +
0.044715 x^3))), in plain Edge ops XNNPACK takes, before the partition search.

A copy (`clone`) XNNPACK takes whose result is used outside the delegate runs on the
CPU when its output would pass another value through once XNNPACK elides it (a copy of
a delegate input, or of a value the delegate returns anyway), which the delegate refuses
("Output node ... is already in the inputs"; stock fails so).

Other node visitors read less of a node than its op means, and stock's configs take
the node anyway (found by tests/backends/xnnpack/test_xnnpack_support_table.py, which
compiles every op the configs claim with each non-tensor argument off its default):
`RULES` holds the rules, each a small function saying what stock does wrong, and
`refuse_in_configs` makes every config check them first, so such a node is neither kept
whole at decomposition nor taken by the partition search, and runs on the CPU with that
reason. Where a plain rewrite keeps the node right on XNNPACK, it is rewritten instead
(`hardtanh_bounds_spelled_out`).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
from torch.export import ExportedProgram

from executorch.backends.xnnpack.utils.xnnpack_constants import XNN_MAX_TENSOR_DIMS
from executorch.backends.xnnpack.utils.quant_utils import (
    extract_qdq_affine_op_args_for_decomposed_ops,
    is_dynamic_qdq,
    is_per_channel_group,
)

from compiler.backends.node_rules import RuleBook, first_refusal
from compiler.backends.xnnpack import fixes
from compiler.ir import dynamic
from compiler.ir.dialect import op_name
from compiler.ir.errors import CompileError
from compiler.ir.invariants import register_rank_limit
from compiler.ir.graph import lift_constant
from compiler.ir.private_api import edge_ops

exir_ops = edge_ops()

logger = logging.getLogger(__name__)

DEQUANTIZE_AFFINE = "torchao.dequantize_affine.default"

# GEMM op -> (weight argument, activation argument), as stock's GEMM configs read them.
GEMM_ARGUMENTS = {
    "aten.linear.default": (1, 0),
    "aten.convolution.default": (1, 0),
    "aten.mm.default": (1, 0),
    "aten.addmm.default": (2, 1),
}

WEIGHT_ONLY_REASON = (
    "XNNPACK 1.5.1 drops the scales of a weight-only dequantize_affine (one outside a dynamically "
    "quantized GEMM, x @ qdata.T), so the CPU dequantizes the weight with plain cast, sub and mul ops"
)
GEMM_REASON = (
    "XNNPACK's float matrix multiplies take constant weights only, and this weight is dequantized "
    "on the CPU (weight-only quantization); quantize with torchao's "
    "Int8DynamicActivationIntxWeightConfig to run it on XNNPACK"
)
# Ops between a dequantized weight and the GEMM reading it (linear decomposes to permute + addmm).
_WEIGHT_LAYOUT_OPS = {"aten.permute_copy.default", "aten.t_copy.default", "aten.view_copy.default"}


def _is_dequantize_affine(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and op_name(node.target) == DEQUANTIZE_AFFINE


def _dynamic_gemm_weight(dequantize: torch.fx.Node, user: torch.fx.Node) -> bool:
    """`user` is a GEMM reading `dequantize` as its weight and an int8 dynamically
    quantized activation: the one pattern XNNPACK lowers with the scales."""
    if user.op != "call_function":
        return False
    arguments = GEMM_ARGUMENTS.get(op_name(user.target))
    if arguments is None or len(user.args) <= max(arguments):
        return False
    weight, activation = (user.args[i] for i in arguments)
    return weight is dequantize and isinstance(activation, torch.fx.Node) and is_dynamic_qdq(activation)


def scales_dropped(node: torch.fx.Node) -> Optional[str]:
    """Why XNNPACK must not lower this dequantize_affine (it would drop its scales), or None."""
    if not _is_dequantize_affine(node) or is_dynamic_qdq(node):
        return None  # not a dequantize_affine, or the activation side of a dynamic GEMM
    if node.users and all(_dynamic_gemm_weight(node, user) for user in node.users):
        return None
    return WEIGHT_ONLY_REASON


def _argument(node: torch.fx.Node, position: int, name: str, default):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _blocked_shapes(block_size: list[int], shape: list[int]) -> tuple[list[int], list[int]]:
    """(the input's shape with every partial block dim split in (blocks, block), the
    scale's shape broadcast against it): torchao's `_get_reduction_params`, inverted."""
    blocked, per_block = [], []
    for block, size in zip(block_size, shape):
        if block != size and block > 1:
            blocked += [size // block, block]
            per_block += [size // block, 1]
        else:
            blocked.append(size)
            per_block.append(1 if block != 1 else size)
    return blocked, per_block


def _call(graph: torch.fx.Graph, op, args: tuple, value: torch.Tensor, kwargs: dict | None = None) -> torch.fx.Node:
    node = graph.call_function(op, args, kwargs or {})
    node.meta["val"] = value
    return node


def _view(graph: torch.fx.Graph, source: torch.fx.Node, shape: list[int]) -> torch.fx.Node:
    value = source.meta["val"]
    if list(value.shape) == list(shape):
        return source
    return _call(graph, exir_ops.edge.aten.view_copy.default, (source, list(shape)), value.reshape(shape).clone())


def _cast(graph: torch.fx.Graph, source: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    value = source.meta["val"]
    if value.dtype == dtype:
        return source
    dim_order = list(range(value.dim()))
    return _call(
        graph,
        exir_ops.edge.dim_order_ops._to_dim_order_copy.default,
        (source,),
        value.to(dtype),
        {"dtype": dtype, "dim_order": dim_order},
    )


def _binary(graph: torch.fx.Graph, op, left: torch.fx.Node, right: torch.fx.Node, compute) -> torch.fx.Node:
    return _call(graph, op, (left, right), compute(left.meta["val"], right.meta["val"]))


def _static(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and all(isinstance(d, int) for d in value.shape)


def _dequantized(graph: torch.fx.Graph, quantized: torch.fx.Node, block_size: list[int], scale: torch.fx.Node,
                 zero_point: torch.fx.Node | None, output_dtype: torch.dtype) -> torch.fx.Node:
    """The nodes computing what torchao's `dequantize_affine` computes:
    (float(q) - float(zero_point)) * scale, per block, in the output dtype."""
    shape = list(quantized.meta["val"].shape)
    blocked, per_block = _blocked_shapes(list(block_size), shape)
    value = _cast(graph, _view(graph, quantized, blocked), output_dtype)
    if zero_point is not None:
        zero = _cast(graph, _view(graph, zero_point, per_block), output_dtype)
        value = _binary(graph, exir_ops.edge.aten.sub.Tensor, value, zero, torch.sub)
    value = _binary(graph, exir_ops.edge.aten.mul.Tensor, value, _view(graph, scale, per_block), torch.mul)
    return _cast(graph, _view(graph, value, shape), output_dtype)


def _decompose_dequantize(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    quantized, block_size, scale, zero_point = node.args[:4]
    with graph.inserting_before(node):
        return _dequantized(graph, quantized, block_size, scale, zero_point,
                            _argument(node, 7, "output_dtype", torch.float32))


def _looked_up_by_row(node: torch.fx.Node) -> bool:
    """A table quantized in blocks of one row (a quantized Embedding's), read only by lookups."""
    block_size = list(node.args[1])
    return (
        len(block_size) == 2 and block_size[0] == 1 and bool(node.users)
        and all(op_name(user.target) == "aten.embedding.default" and user.args[0] is node for user in node.users)
    )


def _lookup(graph: torch.fx.Graph, table: torch.fx.Node, indices: torch.fx.Node) -> torch.fx.Node:
    value = torch.nn.functional.embedding(indices.meta["val"], table.meta["val"])
    return _call(graph, exir_ops.edge.aten.embedding.default, (table, indices), value)


def _rows_then_dequantized(graph: torch.fx.Graph, node: torch.fx.Node, lookup: torch.fx.Node) -> torch.fx.Node:
    """`embedding(dequantize(table), ids)` as `dequantize(embedding(table, ids), its rows' scales)`:
    the same values, but only the looked-up rows are dequantized, not the whole table at every call
    (GPT-2 small's 50257-row table: 150 ms a call, three times the float program's run)."""
    quantized, block_size, scale, zero_point = node.args[:4]
    rows, columns = quantized.meta["val"].shape
    groups = columns // block_size[1]
    indices = lookup.args[1]
    count = indices.meta["val"].numel()
    with graph.inserting_before(lookup):
        codes = _view(graph, _lookup(graph, quantized, indices), [count, columns])
        scales = _view(graph, _lookup(graph, _view(graph, scale, [rows, groups]), indices), [count, groups])
        zeros = None
        if zero_point is not None:
            zeros = _view(graph, _lookup(graph, _view(graph, zero_point, [rows, groups]), indices), [count, groups])
        value = _dequantized(graph, codes, [1, block_size[1]], scales, zeros,
                             _argument(node, 7, "output_dtype", torch.float32))
        return _view(graph, value, list(lookup.meta["val"].shape))


def _decomposable(node: torch.fx.Node) -> bool:
    """Static shapes whose blocks divide them, as torchao itself asserts."""
    quantized, block_size, scale = node.args[:3]
    if not all(_static(n) for n in (quantized, scale)):
        return False
    shape = list(quantized.meta["val"].shape)
    blocked, per_block = _blocked_shapes(list(block_size), shape)
    zero_point = node.args[3] if len(node.args) > 3 else None
    return (
        len(block_size) == len(shape)
        and all(b <= 1 or s % b == 0 for b, s in zip(block_size, shape))
        and math.prod(per_block) == scale.meta["val"].numel()
        and (zero_point is None or (_static(zero_point) and zero_point.meta["val"].numel() == math.prod(per_block)))
    )


def _weight_of(gemm: torch.fx.Node, name: str):
    position = GEMM_ARGUMENTS[name][0]
    return gemm.args[position] if len(gemm.args) > position else None


def _gemms_reading(weight: torch.fx.Node) -> list[torch.fx.Node]:
    """The GEMMs reading `weight` as their weight, through layout ops (permute, view)."""
    found, frontier = [], [weight]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            name = op_name(user.target) if user.op == "call_function" else ""
            if name in _WEIGHT_LAYOUT_OPS:
                frontier.append(user)
            elif name in GEMM_ARGUMENTS and _weight_of(user, name) is node:
                found.append(user)
    return found


def replace_uses(program: ExportedProgram, old: torch.fx.Node, new: torch.fx.Node) -> None:
    """Every use of `old` reads `new`, the program's output list included."""
    old.replace_all_uses_with(new)
    for spec in program.graph_signature.output_specs:
        if getattr(spec.arg, "name", None) == old.name:
            spec.arg.name = new.name


def _undecomposable_error(nodes: list[str]) -> CompileError:
    return CompileError(
        f"XNNPACK 1.5.1 lowers these weight-only {DEQUANTIZE_AFFINE} nodes wrongly (it drops "
        "their scales), and their symbolic or uneven blocks cannot be dequantized on the CPU "
        "here (the runtime has no kernel for the op)",
        nodes=nodes,
        hint="quantize with torchao's Int8DynamicActivationIntxWeightConfig (XNNPACK runs it), "
        "or give the quantized weight static shapes its block size divides",
    )


def _eight_bit_groups(node: torch.fx.Node) -> bool:
    """A dynamically quantized GEMM's weight with per-group scales (fewer columns than a row has;
    a group of a whole row is a scale per channel) and more than 4 bits."""
    if not (_is_dequantize_affine(node) and node.users and is_per_channel_group(node)):
        return False
    grouped = node.args[1][-1] < node.args[0].meta["val"].shape[-1]
    quant_max = extract_qdq_affine_op_args_for_decomposed_ops(node)[4]
    return grouped and quant_max > 7 and all(_dynamic_gemm_weight(node, user) for user in node.users)


def refuse_eight_bit_groups(program: ExportedProgram) -> None:
    """XNNPACK's group-quantized GEMM (qb4w) takes 4-bit weights only: stock's lowering fails on
    8-bit weights with per-group scales with an assertion, and the CPU has no kernel for their
    dequantize_affine; a `CompileError` says so before the partition search."""
    stuck = [node.name for node in program.graph.nodes if _eight_bit_groups(node)]
    if stuck:
        raise CompileError(
            "XNNPACK lowers per-group weight scales only for 4-bit weights (its qb4w GEMM); these "
            f"{DEQUANTIZE_AFFINE} nodes give 8-bit weights per-group scales, and the CPU has no kernel for them",
            nodes=stuck,
            hint="quantize 8-bit weights per_channel (8da8w per_channel), or 4-bit weights per group (8da4w)",
        )


def dequantize_with_plain_ops(program: ExportedProgram) -> dict[str, str]:
    """Rewrites every dequantize_affine XNNPACK would lower wrongly into plain Edge ops,
    in place. Returns new node name -> why it is there (for the placement plan)."""
    if not fixes.on("dequantize_with_plain_ops"):
        return {}
    graph = program.graph_module.graph
    wrong = [n for n in graph.nodes if scales_dropped(n)]
    stuck = [n.name for n in wrong if not _decomposable(n)]
    if stuck:
        raise _undecomposable_error(stuck)
    made: dict[str, str] = {}
    for node in wrong:
        reason = scales_dropped(node)
        before = set(graph.nodes)
        if _looked_up_by_row(node):
            for lookup in list(node.users):
                replace_uses(program, lookup, _rows_then_dequantized(graph, node, lookup))
                graph.erase_node(lookup)
            reason = f"{reason}; the rows looked up are dequantized, not the table"
        else:
            weight = _decompose_dequantize(graph, node)
            replace_uses(program, node, weight)
            for gemm in _gemms_reading(weight):
                made[gemm.name] = GEMM_REASON
        graph.erase_node(node)
        for new in set(graph.nodes) - before:
            made[new.name] = f"part of {node.name}: {reason}"
    if made:
        graph.lint()
        program.graph_module.recompile()
        logger.info("XNNPACK: weight-only dequantize_affine rewritten into %d plain ops", len(made))
    return made


def _tanh_gelu(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and op_name(node.target) == "aten.gelu.default"
        and _argument(node, 1, "approximate", "none") == "tanh"
    )


class Constants:
    """Constants lifted once per program, named `prefix_i`: XNNPACK takes a binary op with tensor
    operands only (an Edge op with a Python number in a Tensor argument fails the verifier), and a
    float matrix multiply with a constant weight only."""

    def __init__(self, program: ExportedProgram, prefix: str) -> None:
        self.program, self.prefix = program, prefix
        self.fake_mode = torch._guards.detect_fake_mode([n.meta.get("val") for n in program.graph.nodes])
        self.nodes: dict[tuple, torch.fx.Node] = {}

    def __call__(self, value: float, dtype: torch.dtype) -> torch.fx.Node:
        """A 0-d constant."""
        return self.tensor(torch.tensor(value, dtype=dtype))

    def tensor(self, value: torch.Tensor) -> torch.fx.Node:
        key = (value.dtype, tuple(value.shape), value.numpy().tobytes())
        if key not in self.nodes:
            taken = set(self.program.constants) | {n.name for n in self.program.graph.nodes}
            name = next(f"{self.prefix}_{i}" for i in range(len(taken) + 1) if f"{self.prefix}_{i}" not in taken)
            self.nodes[key] = lift_constant(self.program, name, value, self.fake_mode)
        return self.nodes[key]


def tanh_gelu_as_plain_ops(program: ExportedProgram) -> int:
    """Rewrites every tanh GELU into the ops of its formula, in place; returns how many."""
    if not fixes.on("tanh_gelu_as_plain_ops"):
        return 0
    graph = program.graph_module.graph
    gelus = [n for n in graph.nodes if _tanh_gelu(n)]
    coefficient = Constants(program, "_gelu_coefficient")
    mul, add = exir_ops.edge.aten.mul.Tensor, exir_ops.edge.aten.add.Tensor
    for node in gelus:
        x = node.args[0]
        dtype = x.meta["val"].dtype
        half, one, cubic, scale = (coefficient(v, dtype) for v in (0.5, 1.0, 0.044715, math.sqrt(2 / math.pi)))
        with graph.inserting_before(node):
            cube = _binary(graph, mul, _binary(graph, mul, x, x, torch.mul), x, torch.mul)
            inner = _binary(graph, mul, _binary(graph, add, x, _binary(graph, mul, cube, cubic, torch.mul), torch.add), scale, torch.mul)
            tanh = _call(graph, exir_ops.edge.aten.tanh.default, (inner,), torch.tanh(inner.meta["val"]))
            gelu = _binary(graph, mul, _binary(graph, mul, x, half, torch.mul), _binary(graph, add, tanh, one, torch.add), torch.mul)
        replace_uses(program, node, gelu)
        graph.erase_node(node)
    if gelus:
        program.graph_module.recompile()
        logger.info("XNNPACK: %d tanh GELUs rewritten into the ops of their formula", len(gelus))
    return len(gelus)


COPY_LEAVES_DELEGATE = (
    "XNNPACK drops copies, and this is a copy whose result leaves the delegate: its output would "
    "be another value passed through (stock: 'Output node ... is already in the inputs')"
)


def _leaves(node: torch.fx.Node, tag: str) -> bool:
    return any(user.op == "output" or user.meta.get("delegation_tag") != tag for user in node.users)


def _copied_value(copy: torch.fx.Node, tag: str) -> torch.fx.Node:
    """What a copy copies, past the copies of its delegate before it (XNNPACK drops them all)."""
    source = copy.args[0]
    while source.meta.get("delegation_tag") == tag and "clone" in op_name(source.target):
        source = source.args[0]
    return source


def copies_leaving_the_delegate(program: ExportedProgram) -> dict[str, str]:
    """Untag the copies XNNPACK took whose result is used outside their delegate and would pass
    a value through once dropped: a copy of a delegate input, or of a value the delegate also
    returns (itself or through another such copy); their reasons. A leaving copy of a value
    computed and used only inside stays, as in stock: the delegate returns that value instead.
    The delegate's own users of a copy sent to the CPU read what it copies (the same values),
    so the copy does not sit between two ops of one delegate, which would split it."""
    leaving: dict[tuple[torch.fx.Node, str], list[torch.fx.Node]] = {}
    for node in program.graph.nodes:
        tag = node.meta.get("delegation_tag")
        if tag and "clone" in op_name(node.target) and _leaves(node, tag):
            leaving.setdefault((_copied_value(node, tag), tag), []).append(node)
    untagged = {}
    for (value, tag), copies in leaving.items():
        inside = value.op != "placeholder" and value.meta.get("delegation_tag") == tag
        if inside and len(copies) == 1 and not _leaves(value, tag):
            continue
        for node in copies:
            del node.meta["delegation_tag"]
            untagged[node.name] = COPY_LEAVES_DELEGATE
            for user in [u for u in node.users if u.meta.get("delegation_tag") == tag]:
                user.replace_input_with(node, node.args[0])
    if untagged:
        program.graph_module.recompile()
    return untagged


def hardtanh_bounds_spelled_out(program: ExportedProgram) -> int:
    """Stock's hardtanh visitor (operators/op_hardtanh.py) reads `args[2]` whenever `args[1]`
    is there: `hardtanh(x, 0.5)` (max_val left at its default) fails inside to_backend with
    "tuple index out of range". Each hardtanh gets both bounds written out, in place,
    before the partition search; returns how many."""
    spelled = 0
    for node in program.graph.nodes:
        if node.op == "call_function" and op_name(node.target) == "aten.hardtanh.default" and len(node.args) == 2:
            node.args = (*node.args, node.kwargs.get("max_val", 1.0))
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "max_val"}
            spelled += 1
    if spelled:
        program.graph_module.recompile()
    return spelled


# --- nodes stock's configs take and its node visitors lower wrongly: refused ------------

# Every rule: None when stock's config may take the node, else the reason it may not.
RULES = RuleBook("XNNPACK", __name__)


@RULES.refuses("ExecuTorch's LLM ops (`llama::custom_sdpa`, `llama::update_cache`): CPU kernels only")
def llm_custom_op(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """ExecuTorch's LLM ops (`llama::custom_sdpa`, `llama::update_cache`, also inside the
    `auto_functionalized` call a mutating one becomes) have CPU kernels only: say that, not
    what stock or another rule would say of their arguments."""
    op = node.args[0] if isinstance(node.target, torch._ops.HigherOrderOperator) and node.args else node.target
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.name.startswith("llama::"):
        return None
    return (
        f"ExecuTorch's LLM op {schema.name}: chosen for the attention and KV cache, it "
        "runs as its CPU kernel (extension/llm/custom_ops), which XNNPACK has no operator for"
    )


@RULES.refuses("an op given a dynamic size: XNNPACK takes sizes fixed when the delegate is built")
def reads_a_dynamic_size(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """XNNPACK's operators take their sizes as numbers fixed when the delegate is built (a view's
    target shape may infer one -1). Stock's configs refuse every argument that is not a tensor,
    and say 'invalid dtype' of a size read from `sym_size`: this names the dimension instead."""
    symbols = dynamic.symbols_read(node)
    if not symbols:
        return None
    return (
        f"XNNPACK takes the sizes an op is given as numbers fixed at compile time, and this op is given "
        f"the dynamic size {dynamic.describe_sizes(node.graph, symbols)}"
    )


register_rank_limit("XnnpackBackend", XNN_MAX_TENSOR_DIMS)  # the invariant behind the rule below


@RULES.refuses(f"a tensor of more than {XNN_MAX_TENSOR_DIMS} dimensions: the runtime refuses the program at load")
def too_many_dimensions(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """XNNPACK defines tensors of at most XNN_MAX_TENSOR_DIMS dimensions; stock's configs do not
    check it, so a video patchify's 7-D view was delegated and the program failed to load
    ("Failed to define tensor 0 with code: xnn_status_unsupported_parameter")."""
    values = [node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes)]
    ranks = [v.dim() for v in values if isinstance(v, torch.Tensor)]
    if not ranks or max(ranks) <= XNN_MAX_TENSOR_DIMS:
        return None
    return (
        f"XNNPACK takes tensors of at most {XNN_MAX_TENSOR_DIMS} dimensions, and this op reads or makes a "
        f"{max(ranks)}-D one; merge dimensions in the model (reshape) to delegate it"
    )


@RULES.refuses("`addmm` with `beta` or `alpha` other than 1: stock's visitor ignores both")
def addmm_scaled(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """Stock's addmm visitor (operators/op_addmm.py) serializes a FullyConnected of the bias,
    input and weight and never reads `beta` or `alpha`, which AddmmConfig does not check:
    `addmm(b, x, w, beta=0.5)` comes out `b + x @ w`, silently."""
    if op_name(node.target) != "aten.addmm.default" or not fixes.on("addmm_scaled"):
        return None
    scales = {name: _argument(node, position, name, 1) for position, name in ((3, "beta"), (4, "alpha"))}
    off = {name: value for name, value in scales.items() if value != 1}
    if not off:
        return None
    shown = ", ".join(f"{name}={value}" for name, value in off.items())
    return (
        f"XNNPACK 1.5.1 would compute this addmm ({shown}) wrongly: its addmm visitor ignores beta and "
        "alpha (it computes bias + input @ weight)"
    )


@RULES.refuses("`max.dim` not over dim 2 or 3 with `keepdim=True`: stock lowers it as a 4-D max pool")
def max_dim_stock_cannot_pool(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """Stock's max.dim visitor (operators/op_max_dim.py) lowers a max over dim 2 or 3, with
    keepdim, as a 4-D max pooling, and raises from inside to_backend for any other dim
    (-1 and -2 too: "amax.default only supports dim == 2 or dim == 3") or without keepdim;
    MaxDimConfig checks neither."""
    if op_name(node.target) != "aten.max.dim":
        return None
    dim, keepdim = _argument(node, 1, "dim", None), _argument(node, 2, "keepdim", False)
    if dim in (2, 3) and keepdim is True and len(node.args) == 3:
        return None
    return (
        f"XNNPACK 1.5.1 cannot take max.dim with dim={dim}, keepdim={keepdim}: it pools only dim 2 or 3 "
        "with keepdim=True"
    )


# Ops stock's ChannelsLastTaggedReshapePass lowers in NHWC, asserting their input is 4-D,
# whose configs do not check it (convolution's 1-D case is unsqueezed before the pass).
_NHWC_UNCHECKED = ("aten.max_pool2d.default", "aten.avg_pool2d.default", "aten.prelu.default")


@RULES.refuses("a pool or PReLU of an input that is not 4-D: stock lowers them in NHWC")
def nhwc_op_not_4d(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """XNNPACK lowers pools and PReLU in NHWC: stock's ChannelsLastTaggedReshapePass asserts
    their input is 4-D ("Attempting to convert non-NHWC compatible node to NHWC", from
    inside to_backend), which MaxPool2dConfig, AvgPoolingConfig and PreluConfig do not
    check: an unbatched (C, H, W) pool, or a PReLU over (N, C, L), failed to compile."""
    if op_name(node.target) not in _NHWC_UNCHECKED or not isinstance(node.args[0], torch.fx.Node):
        return None
    value = node.args[0].meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() == 4:
        return None
    return (
        f"XNNPACK 1.5.1 takes {op_name(node.target)} of 4-D inputs only (it lowers it in NHWC), and this "
        f"input is {value.dim()}-D; reshape it to 4-D in the model to delegate it"
    )


@RULES.refuses("bilinear upsampling by `scale_factors` not of the output's ratio: XNNPACK reads only the size")
def bilinear_scale_unlike_size(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """Stock's upsample_bilinear2d visitor (operators/op_static_resize_bilinear_2d.py) passes
    XNNPACK the output size only, so it samples at in / out steps; torch, given
    `scale_factors` and align_corners=False, samples at 1 / scale steps. Where out is not
    in * scale (a scale of 2.2 over 3 rows gives 6 rows) the numbers differ, silently
    (0.46 off in the sweep)."""
    if op_name(node.target) != "aten.upsample_bilinear2d.vec" or not fixes.on("bilinear_scale_unlike_size"):
        return None
    scales = _argument(node, 3, "scale_factors", None)
    if not scales or _argument(node, 2, "align_corners", False):
        return None
    source, result = node.args[0].meta.get("val"), node.meta.get("val")
    if source is None or result is None:
        return None
    sizes = zip(source.shape[-2:], result.shape[-2:], scales)
    if all(isinstance(size, int) and size * scale == out for size, out, scale in sizes):
        return None
    return (
        f"XNNPACK 1.5.1 would resize with other values than torch: scale_factors={list(scales)} give an "
        "output of another ratio, and its bilinear resize ignores them (it samples at input / output "
        "size steps, torch at 1 / scale); pass size= instead of scale_factor= to delegate it"
    )


def refuse_in_configs(partitioner) -> None:
    """Make every config of `partitioner` apply `RULES` before its own check: a node a
    rule refuses is then neither kept whole (`ops_to_not_decompose` asks the same check)
    nor taken by the partition search."""
    for config in partitioner.target_partitioner_configs.values():
        stock = config.check_constraints

        def check(node: torch.fx.Node, ep: ExportedProgram, stock=stock) -> bool:
            return first_refusal(node, RULES) is None and stock(node, ep)

        config.check_constraints = check


def refused_nodes(program: ExportedProgram) -> dict[str, str]:
    """Node name -> the reason a rule refuses it, for the placement plan."""
    return {node.name: reason for node in program.graph.nodes if (reason := first_refusal(node, RULES))}
