"""Which nodes the MLX delegate may take, on top of ExecuTorch's MLX support check.

Each rule is a small predicate with a one-line reason, registered in `RULES` with
the summary docs/refusal-rules.md lists. A node a rule refuses stays on the CPU with
that reason in the placement report.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Iterator, Optional

import torch
from torch.fx.passes.operator_support import OperatorSupportBase

from compiler.backends.mlx.rewrites import (
    DEQUANTIZE,
    FLOAT_WEIGHT,
    MLX_GROUP_SIZES,
    copy_mismatch,
    quantized_layout,
    quantized_layout_mlx_refuses,
    torch_nearest_scales,
)
from compiler.backends.mlx import fixes
from compiler.backends.mlx.arguments import ignored_argument, schema_of
from compiler.backends.node_rules import RuleBook, first_refusal
from compiler.ir.dialect import op_name
from compiler.ir.private_api import aten_overload, mlx_nearest_source_indices

# Every rule: None when MLX may take the node, else the reason it may not.
RULES = RuleBook("MLX", __name__)

# Names under which ATen schemas take index tensors (index.Tensor, index_put,
# _unsafe_index, index_select, gather, scatter, take_along_dim, index_copy, ...).
_INDEX_ARGUMENTS = ("indices", "index")


def _index_tensors(node: torch.fx.Node) -> Iterator[torch.fx.Node]:
    """The graph nodes `node` reads as index tensors (inside lists too)."""
    schema = schema_of(node)
    if schema is None:
        return
    for position, argument in enumerate(schema.arguments):
        if argument.name not in _INDEX_ARGUMENTS:
            continue
        if argument.name in node.kwargs:
            value = node.kwargs[argument.name]
        elif position < len(node.args) and not argument.kwarg_only:
            value = node.args[position]
        else:
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, torch.fx.Node):
                yield item


def _dtype(node: torch.fx.Node) -> Optional[torch.dtype]:
    value = node.meta.get("val")
    return getattr(value, "dtype", None)


@RULES.refuses("an index by a boolean mask: MLX gathers with integer indices only")
def boolean_index(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """MLX gathers only with integer indices: mlx.core.take(x, bool_indices) raises
    "[Gather] Boolean indices not supported", and stock 1.5.1's index handler passes
    a bool mask through as if it held positions. A constant mask reaches here already
    turned into integer positions by the fold stage; any other runs on the CPU."""
    masks = [i for i in _index_tensors(node) if _dtype(i) == torch.bool]
    if not masks:
        return None
    why = (
        "a constant mask the fold stage did not turn into integer positions"
        if all(m.op == "placeholder" for m in masks)
        else "a mask computed at run time has no constant positions to turn it into"
    )
    return (
        f"MLX gathers only with integer indices, and this op takes the boolean index "
        f"{', '.join(m.name for m in masks)} ([Gather] Boolean indices not supported): {why}"
    )


def _rank(node: object) -> Optional[int]:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value.dim() if isinstance(value, torch.Tensor) else None


@RULES.refuses("`index.Tensor` by one index of the input's rank: stock gathers element-wise (`take_along_axis`)")
def same_rank_single_index(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """Stock 1.5.1's aten.index.Tensor handler lowers one index tensor of the input's
    rank to TakeAlongAxisNode (mlx take_along_axis), an element-wise gather: `x[rows]`
    with x [4, 8] and rows [2, 2] should give [2, 2, 8] but fails to broadcast (or,
    when the shapes broadcast, silently gives other values). Rank 1 is the same as a take."""
    if op_name(node.target) != "aten.index.Tensor" or len(node.args) < 2 or not fixes.on("same_rank_single_index"):
        return None
    given = [i for i in node.args[1] if i is not None]
    if len(given) != 1:
        return None
    rank, index_rank = _rank(node.args[0]), _rank(given[0])
    if rank is not None and rank > 1 and index_rank == rank:
        return (
            f"ExecuTorch 1.5.1's MLX lowering would gather the wrong values: the index tensor {given[0].name} "
            f"has the input's rank ({rank}), which it turns into take_along_axis, an element-wise "
            "gather instead of whole slices"
        )
    return None


@functools.cache
def _mlx_holds(dtype: torch.dtype) -> bool:
    """Whether an MLX payload can hold a tensor of `dtype` (stock's own dtype table)."""
    from executorch.backends.mlx.builder.op_helpers import torch_dtype_to_scalar_type

    try:
        torch_dtype_to_scalar_type(dtype)
    except ValueError:
        return False
    return True


def _tensors_touched(node: torch.fx.Node) -> Iterator[tuple[str, torch.dtype]]:
    """(what, dtype) of every tensor `node` reads, inside lists too, and of what it returns."""
    read: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), read.append)
    for source in read:
        for value in _values(source):
            yield f"reads {source.name}", value.dtype
    for value in _values(node):
        yield "returns a tensor", value.dtype


def _values(node: torch.fx.Node) -> list[torch.Tensor]:
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if isinstance(v, torch.Tensor)]


@RULES.refuses("a tensor, inside a list too, of a dtype MLX cannot hold (float64, int16, complex)")
def dtype_mlx_cannot_hold(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """The MLX payload has no float64 (nor int16, complex, ...) tensors. Stock 1.5.1 checks
    only the tensors a node takes as direct arguments, not those inside a list, so it tags
    `cat([x.sin(), x.cos()])` over float64 and its lowering then fails with "placeholder
    has unsupported dtype"."""
    for what, dtype in _tensors_touched(node):
        if not _mlx_holds(dtype):
            return (
                f"MLX cannot hold {str(dtype).removeprefix('torch.')} tensors, and this op {what} of "
                f"{str(dtype).removeprefix('torch.')}; use float32 in the model to delegate it"
            )
    return None


@RULES.refuses("a copy of a source of another shape or dtype than its destination: stock returns the source")
def copy_source_unlike_destination(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """Stock 1.5.1's MLX aten.copy handler returns its source as is (contiguous(src)), not
    broadcast and cast to the destination. `rewrites.copy_source_like_destination` fixes
    every copy onto a static shape before this check; one onto a symbolic shape stays here."""
    mismatch = copy_mismatch(node)
    if mismatch is None or not fixes.on("copy_source_like_destination"):
        return None
    destination, source = mismatch
    return (
        f"ExecuTorch 1.5.1's MLX lowering would copy wrongly: this copies a "
        f"{str(source.dtype).removeprefix('torch.')} {list(source.shape)} source onto a "
        f"{str(destination.dtype).removeprefix('torch.')} {list(destination.shape)} destination, and "
        "it returns the source unbroadcast and uncast"
    )


def _symbolic_floats(node: torch.fx.Node) -> list[str]:
    """Names of the symbolic floats (`zuf0`, from `.item()` of a float tensor) `node` returns or reads."""
    read: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), read.append)
    return [str(n.meta["val"]) for n in [node, *read] if isinstance(n.meta.get("val"), torch.SymFloat)]


@RULES.refuses("a float read from a tensor at run time (`.item()`): MLX carries tensors, ints and bools only")
def symbolic_float(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """An MLX program carries tensors, SymInt and SymBool values only: stock 1.5.1's slot
    manager has no slot for a symbolic float (NotImplementedError: val_to_idtype: zuf0),
    and its item handler takes only integers. The node making or reading one (multi_task_dit's
    diffusion time, `grid[i].item()`) stays on the CPU, which carries it as a scalar."""
    names = _symbolic_floats(node)
    if not names:
        return None
    return (
        f"MLX cannot carry {', '.join(dict.fromkeys(names))}, a float number read from a tensor at "
        "run time (.item()): an MLX program carries tensors, integers and bools only"
    )


@contextlib.contextmanager
def symbolic_floats_hidden(program) -> Iterator[None]:
    """Stock 1.5.1's MLX support check (MLXProgramBuilder, in `ops_to_not_decompose` and
    `MLXOperatorSupport`) gives every node it declines a slot, and crashes on a symbolic
    float (val_to_idtype: zuf0). While it runs, such values are hidden from it; the
    `symbolic_float` rule refuses their nodes afterwards."""
    hidden = [(n, n.meta.pop("val")) for n in program.graph.nodes if isinstance(n.meta.get("val"), torch.SymFloat)]
    try:
        yield
    finally:
        for node, value in hidden:
            node.meta["val"] = value


def _holds_a_list(value) -> bool:
    return isinstance(value, (list, tuple)) and any(isinstance(v, (list, tuple)) for v in value)


@contextlib.contextmanager
def nested_lists_hidden(program) -> Iterator[None]:
    """Stock 1.5.1's MLX support check gives every node it declines a slot per result, and
    crashes on a result that is itself a list of tensors (`histogramdd`'s bin edges:
    val_to_idtype: [FakeTensor, ...]). No MLX handler makes such a result, so while the check
    runs these values are hidden from it, and it declines their nodes (no handler)."""
    hidden = [(n, n.meta.pop("val")) for n in program.graph.nodes if _holds_a_list(n.meta.get("val"))]
    try:
        yield
    finally:
        for node, value in hidden:
            node.meta["val"] = value


# Multi-output ops whose stock 1.5.1 MLX handler writes only output 0, and what the others are.
_ONLY_FIRST_OUTPUT_WRITTEN = {
    "aten.max_pool1d_with_indices.default": "indices",
    "aten.max_pool2d_with_indices.default": "indices",
    "aten.max_pool3d_with_indices.default": "indices",
    "aten._native_batch_norm_legit_no_training.default": "save_mean and save_invstd",
}


@RULES.refuses("a read of max pooling's indices or batch norm's saved statistics: stock never writes them")
def unwritten_output_read(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """Stock 1.5.1's MLX handlers for max pooling with indices and inference batch norm emit
    only the first output and leave the others' slots unwritten (unlike its other
    multi-output handlers, they do not check `used_getitem_indices`), so a program that
    reads the indices reads a tensor the payload never wrote."""
    what = _ONLY_FIRST_OUTPUT_WRITTEN.get(op_name(node.target))
    if what is None or not fixes.on("unwritten_output_read"):
        return None
    read = sorted(u.args[1] for u in node.users if u.target is operator.getitem and u.args[1] != 0)
    if not read:
        return None
    return (
        f"the model reads output {', '.join(map(str, read))} ({what}) of this op, which ExecuTorch "
        "1.5.1's MLX lowering never writes"
    )


# Ops stock 1.5.1 lowers to MLX's matmul or conv, which take floating types only.
_FLOATING_ONLY = frozenset(
    {
        "aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.matmul.default",
        "aten.linear.default", "aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
        "aten.conv_transpose1d.default", "aten.conv_transpose2d.input", "aten.conv_transpose3d.input",
        "aten.convolution.default",
    }
)


@RULES.refuses("an integer matmul or convolution: MLX takes floating types only")
def integer_matmul_or_conv(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """MLX multiplies matrices and convolves floating types only ("[matmul] Only inexact types
    are supported", "[conv] ... only supports floating point types"); stock 1.5.1 tags an
    integer mm or conv anyway and the runtime throws when it runs."""
    if op_name(node.target) not in _FLOATING_ONLY:
        return None
    dtypes = {dtype for _, dtype in _tensors_touched(node)}
    integers = sorted(str(d).removeprefix("torch.") for d in dtypes if not d.is_floating_point)
    if not integers:
        return None
    return (
        f"MLX's matmul and conv take floating types only, and this op has {', '.join(integers)} operands; "
        "cast them to float in the model to delegate it"
    )


# Defined in `arguments` (the rewrites ask it too), registered here in its place among the rules.
RULES.refuses("`sort`, `argsort` or `topk` given `descending` or `largest` stock's handlers ignore")(ignored_argument)


@RULES.refuses("integer floor division: MLX divides integers into floats")
def integer_floor_division(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """The MLX runtime floor-divides integers through mlx::divide, which promotes to float:
    `i // 2` comes out 3.5 for 7, and an op after it computes on that (a gather refuses
    it as an index; `(i // 2) * 2` gives 7). ExecuTorch's own MoE lowering casts back for
    this reason. Integer floor division stays on the CPU."""
    name = op_name(node.target)
    floor = name == "aten.floor_divide.default" or (
        name == "aten.div.Tensor_mode" and node.kwargs.get("rounding_mode") == "floor"
    )
    value = node.meta.get("val")
    if not floor or not isinstance(value, torch.Tensor) or value.dtype.is_floating_point:
        return None
    if not fixes.on("integer_floor_division"):
        return None
    return (
        f"MLX would get this {str(value.dtype).removeprefix('torch.')} floor division wrong: it divides "
        "integers through mlx::divide, which returns float (7 // 2 gives 3.5)"
    )


def _nearest_sources(node: torch.fx.Node, size_h: int, size_w: int) -> torch.Tensor:
    """The flat input position each output element of this upsample_nearest2d reads in torch."""
    op = aten_overload(node.target)
    positions = torch.arange(size_h * size_w, dtype=torch.float64).reshape(1, 1, size_h, size_w)
    return op(positions, *node.args[1:], **node.kwargs)[0, 0].long()


def _stock_nearest_sources(node: torch.fx.Node, size_h: int, size_w: int, out_h: int, out_w: int) -> torch.Tensor:
    """The same positions as stock 1.5.1's MLX handler computes them (its own index function),
    from the scales `rewrites.nearest_scales_torch_ignores_dropped` leaves it."""
    args = node.args
    if op_name(node.target).endswith(".vec"):
        scales = list(args[2]) if len(args) > 2 and args[2] is not None else [None, None]
    else:
        scales = [args[2] if len(args) > 2 else None, args[3] if len(args) > 3 else None]
    scales = torch_nearest_scales(node.args[0].meta["val"], node.meta["val"], scales)
    rows = mlx_nearest_source_indices(size_h, out_h, scales[0]).long()
    cols = mlx_nearest_source_indices(size_w, out_w, scales[1]).long()
    return rows[:, None] * size_w + cols[None, :]


@RULES.refuses("`var` or `std` with a correction that is not a whole number: stock passes int(correction)")
def fractional_correction(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """Stock 1.5.1's MLX var and std handlers give MLX int(correction) as its ddof, a whole
    number: var(x, correction=0.5) came out as var(x, correction=0), 0.1 off on OpInfo's sample."""
    if op_name(node.target) not in ("aten.var.correction", "aten.std.correction"):
        return None
    correction = node.kwargs.get("correction")
    if correction is None or float(correction).is_integer() or not fixes.on("fractional_correction"):
        return None
    return (
        f"MLX takes a whole-number correction (ddof) for {op_name(node.target)}, and this call passes "
        f"correction={correction} (stock's handler passes int({correction}))"
    )


@RULES.refuses("`repeat_interleave` without a dim: stock repeats along dim 0 where torch flattens first")
def repeat_interleave_without_a_dim(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """torch's repeat_interleave(x, n) with no dim repeats each element of x flattened; stock 1.5.1's
    MLX handler repeats along dim 0 (x of shape (2, 3, 4) came out (4, 3, 4), not (48,))."""
    if op_name(node.target) != "aten.repeat_interleave.self_int":
        return None
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    value = node.args[0].meta.get("val")
    if dim is not None or (isinstance(value, torch.Tensor) and value.dim() == 1):
        return None
    if not fixes.on("repeat_interleave_flattened"):
        return None
    return (
        "torch's repeat_interleave without a dim repeats the flattened input, and stock's MLX handler "
        "repeats along dim 0 instead"
    )


def _first_input(node: torch.fx.Node) -> Optional[torch.Tensor]:
    first = node.args[0] if node.args else None
    value = first.meta.get("val") if isinstance(first, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


@RULES.refuses("an op over a dim of a 0-d tensor: MLX's reductions and squeeze take no axis of a 0-d array")
def dim_of_a_zero_d_tensor(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """amin(x, [-1]) of a 0-d x is x in torch; MLX refuses the axis when the payload runs ("Invalid
    axis -1 for array with 0 dimensions"), so the call stays on the CPU."""
    x, schema = _first_input(node), schema_of(node)
    if x is None or x.dim() or schema is None or not any(a.name == "dim" for a in schema.arguments):
        return None
    dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if dims in (None, []) or op_name(node.target) in ("aten.unsqueeze_copy.default", "aten.unsqueeze.default"):
        return None
    return f"MLX takes no axis of a 0-d array, and this {op_name(node.target)} reduces or squeezes dim {dims} of one"


_POOLS = {f"aten.{kind}_pool{n}d{suffix}.default": n for kind in ("max", "avg") for n in (1, 2, 3)
          for suffix in ("", "_with_indices")}


@RULES.refuses("a pool of an unbatched input: stock's handler transposes it as a batched one")
def pool_of_an_unbatched_input(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """A 2-D pool of a (channels, height, width) input: stock 1.5.1's MLX handler transposes it to
    channels-last with the axes of a batched input, which MLX refuses when the payload runs
    ("[transpose] Received 4 axes for array with 3 dimensions"; OpInfo's adaptive_max_pool1d of a
    2-D input, decomposed to such a pool)."""
    spatial, x = _POOLS.get(op_name(node.target)), _first_input(node)
    if spatial is None or x is None or x.dim() != spatial + 1:
        return None
    return f"stock's MLX handler pools batched inputs only, and this {op_name(node.target)} reads an unbatched one"


@RULES.refuses("nearest upsampling reading other source rows or columns than torch: stock steps in float64")
def nearest_rows_unlike_torch(node: torch.fx.Node, ctx=None) -> Optional[str]:
    """Stock 1.5.1's MLX upsample_nearest2d handler steps by 1 / scale in float64; torch copies
    or halves the index when the output is the input's size or twice it, and steps in float32.
    `rewrites.nearest_scales_torch_ignores_dropped` fixes the first; any call whose source
    positions still differ from torch's (a scale like 49.0, where float32 and float64 round
    apart) stays on the CPU."""
    if op_name(node.target) not in ("aten.upsample_nearest2d.default", "aten.upsample_nearest2d.vec"):
        return None
    source, result = node.args[0].meta.get("val"), node.meta.get("val")
    sizes = (*source.shape[-2:], *result.shape[-2:]) if source is not None and result is not None else ()
    if len(sizes) != 4 or not all(isinstance(size, int) for size in sizes):
        return None
    if not fixes.on("nearest_rows_unlike_torch"):
        return None
    if torch.equal(_nearest_sources(node, *sizes[:2]), _stock_nearest_sources(node, *sizes)):
        return None
    return (
        "MLX's nearest upsampling would read other source rows or columns than torch: ExecuTorch "
        "1.5.1's MLX handler steps by 1 / scale in float64 where torch rounds in float32"
    )


class GuardedSupport(OperatorSupportBase):
    """ExecuTorch's MLX support check, with our rules applied first."""

    def __init__(self, stock: OperatorSupportBase) -> None:
        self.stock = stock
        self.refused: dict[str, str] = {}

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        reason = first_refusal(node, RULES) or _dead_only_to_stock(node)
        if reason:
            self.refused[node.name] = reason
            return False
        return self.stock.is_node_supported(submodules, node)


def _dead_only_to_stock(node: torch.fx.Node) -> str | None:
    """Stock's check calls a node without a handler of its own supported when all its users
    are dead code; a user our rules send to the CPU is live there, and the node, alone
    in its partition, then fails to lower ("Found unsupported node ... no handler")."""
    from executorch.backends.mlx.builder import REGISTRY

    if REGISTRY.get_handler(node) is not None:
        return None
    refused = next((u for u in node.users if first_refusal(u, RULES)), None)
    if refused is None:
        return None
    return (
        f"MLX has no handler for {op_name(node.target)} of its own, and its user {refused.name} runs "
        "on the CPU, so it does too"
    )


def _fused_reader(program, node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The one reader of a dequantize that stock 1.5.1's QUANTIZED_LINEAR or QUANTIZED_EMBEDDING
    pattern lowers together with it (the weight stays packed), if any."""
    from executorch.backends.mlx.patterns import QuantizedEmbeddingHandler, QuantizedLinearHandler

    for user in node.users:
        for pattern in (QuantizedLinearHandler, QuantizedEmbeddingHandler):
            handler = pattern.maybe_create(program, user)
            if handler is not None and node in handler.body and handler.supported(None, user):
                return user
    return None


def _mlx_group_size(group: int) -> int:
    """The group size stock 1.5.1 packs a weight's groups of `group` in: the largest it takes
    that divides them (a row of 48 quantized per channel: 16)."""
    return next(size for size in reversed(MLX_GROUP_SIZES) if group % size == 0)


def _mlx_group(group: int) -> str:
    size = _mlx_group_size(group)
    return f"groups of {size}" if size == group else f"groups of {size} (its groups of {group} split in {group // size})"


def _dequantized_whole(node: torch.fx.Node) -> str:
    """Why stock 1.5.1 dequantizes this weight whole instead of fusing it with its reader."""
    readers = list(node.users)
    if len(readers) > 1:
        return (
            f"it has {len(readers)} readers (as a tied embedding and lm_head share one), and MLX's "
            "quantized matmul and gather patterns take a weight read once"
        )
    group, reader = _mlx_group_size(quantized_layout(node).group), op_name(readers[0].target) if readers else None
    if reader == "aten.linear.default" and group < 32:
        return f"it is packed in groups of {group}, and MLX's quantized matmul takes groups of 32, 64 or 128"
    return f"its reader {reader} has no quantized form in MLX"


def quantized_weight_reasons(program) -> dict[str, str]:
    """Node name -> how MLX computes it, for each torchao.dequantize_affine and each node reading
    one or reading a weight `rewrites.quantized_weights_mlx_cannot_hold_dequantized` stored in
    float. A dequantize MLX cannot lower stays out: it is on the CPU with stock's reason."""
    reasons = {n.name: n.meta[FLOAT_WEIGHT] for n in program.graph.nodes if FLOAT_WEIGHT in n.meta}
    for node in program.graph.nodes:
        if node.op != "call_function" or op_name(node.target) != DEQUANTIZE or quantized_layout_mlx_refuses(node):
            continue
        layout = quantized_layout(node)
        packed = f"{layout.bits}-bit, packed in {_mlx_group(layout.group)}"
        reader = _fused_reader(program, node)
        if reader is None:
            reasons[node.name] = (
                f"MLX dequantizes the weight ({packed}) whole, at every call (DequantizeNode), because "
                f"{_dequantized_whole(node)}"
            )
            for user in node.users:
                reasons[user.name] = f"computes in float on a weight ({packed}) MLX dequantizes whole ({DEQUANTIZE})"
        elif op_name(reader.target) == "aten.linear.default":
            reasons[reader.name] = f"MLX multiplies by the packed weight ({packed}) in one QuantizedMatmulNode"
            reasons[node.name] = "lowered with the linear reading it into one QuantizedMatmulNode: the weight stays packed"
        else:
            reasons[reader.name] = (
                f"MLX gathers the rows it reads of the packed table ({packed}) and dequantizes only those "
                "(TakeNode, DequantizeNode)"
            )
            reasons[node.name] = "lowered with the embedding reading it into a gather: the table stays packed"
    return reasons
