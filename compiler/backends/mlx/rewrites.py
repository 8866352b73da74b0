"""Rewrites of the Edge program before MLX's support check, for ops stock lowers wrongly.

Each rewrite keeps what the program computes and turns a node that ExecuTorch's
MLX handler would mislower into nodes that handler lowers right, so the op stays
on MLX instead of being refused. What a rewrite cannot fix, a rule in
`support.py` refuses. One (`assertions_dropped`) removes what no ExecuTorch
program runs, so that it keeps no op off MLX.
"""

from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Optional

import torch
from torch.export import ExportedProgram

from compiler.backends.mlx import fixes
from compiler.backends.mlx.arguments import argument, ignored_argument
from compiler.ir.dialect import op_name
from compiler.ir.graph import constant_placeholders, lift_constant
from compiler.ir.private_api import aten_overload, edge_ops

logger = logging.getLogger(__name__)


def _tensor(node: object) -> Optional[torch.Tensor]:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _finished(program: ExportedProgram, changed: int, what: str) -> int:
    """Check and recompile a graph a rewrite changed `changed` times; returns that count."""
    if changed:
        program.graph_module.graph.lint()
        program.graph_module.recompile()
        logger.info("MLX: %d %s", changed, what)
    return changed


def copy_mismatch(node: torch.fx.Node) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) values of an aten.copy whose source differs from its
    destination in shape or dtype, else None."""
    if node.op != "call_function" or op_name(node.target) != "aten.copy.default":
        return None
    destination, source = _tensor(node.args[0]), _tensor(node.args[1])
    if destination is None or source is None:
        return None
    if destination.shape == source.shape and destination.dtype == source.dtype:
        return None
    return destination, source


def _static(shape: torch.Size) -> bool:
    return all(isinstance(d, int) for d in shape)


def _cast(graph: torch.fx.Graph, source: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    exir_ops = edge_ops()

    value = _tensor(source)
    cast = graph.call_function(
        exir_ops.edge.dim_order_ops._to_dim_order_copy.default,
        (source,),
        {"dtype": dtype, "dim_order": list(range(value.dim()))},
    )
    cast.meta["val"] = value.to(dtype)
    return cast


def _expand(graph: torch.fx.Graph, source: torch.fx.Node, shape: torch.Size) -> torch.fx.Node:
    exir_ops = edge_ops()

    expand = graph.call_function(exir_ops.edge.aten.expand_copy.default, (source, list(shape)))
    expand.meta["val"] = _tensor(source).expand(shape).clone()
    return expand


def copy_source_like_destination(program: ExportedProgram) -> int:
    """aten.copy(self, src) returns a tensor of self's shape and dtype holding src broadcast
    and cast. Stock 1.5.1's MLX handler emits contiguous(src), which keeps src's shape and
    dtype: `y[0:1] = 3.0` over all of a (1, 4) `y` comes back 0-d (and the C++ runtime
    cannot resize the static (1, 4) output to it). Giving the copy a source already cast
    and expanded to self's static shape makes that handler right. Returns how many copies
    changed; a copy onto a symbolic shape is left for `support.copy_source_unlike_destination`."""
    if not fixes.on("copy_source_like_destination"):
        return 0
    graph = program.graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        mismatch = copy_mismatch(node)
        if mismatch is None or not _static(mismatch[0].shape):
            continue
        destination, source = mismatch
        with graph.inserting_before(node):
            new_source = node.args[1]
            if source.dtype != destination.dtype:
                new_source = _cast(graph, new_source, destination.dtype)
            if source.shape != destination.shape:
                new_source = _expand(graph, new_source, destination.shape)
        node.args = (node.args[0], new_source, *node.args[2:])
        changed += 1
    return _finished(program, changed, "copies given a source of their destination's shape and dtype")


def _edge_call(graph: torch.fx.Graph, target: str, args: tuple, value) -> torch.fx.Node:
    """A new Edge call to `aten.<target>` whose value (meta) is `value`."""
    exir_ops = edge_ops()

    overload_packet, _, overload = target.partition(".")
    node = graph.call_function(getattr(getattr(exir_ops.edge.aten, overload_packet), overload), args)
    node.meta["val"] = value
    return node


def _ascending_sort(graph: torch.fx.Graph, source: torch.fx.Node, dim: int) -> tuple[torch.fx.Node, ...]:
    """sort(source, dim) ascending, and its (values, indices) items."""
    import operator

    values, indices = torch.sort(_tensor(source), dim)
    node = _edge_call(graph, "sort.default", (source, dim, False), (values, indices))
    items = []
    for position, value in enumerate((values, indices)):
        item = graph.call_function(operator.getitem, (node, position))
        item.meta["val"] = value
        items.append(item)
    return tuple(items)


def _reorder(graph: torch.fx.Graph, item: torch.fx.Node, dim: int, k: Optional[int]) -> torch.fx.Node:
    """Descending from ascending: the whole item flipped along dim (k None), or its first k."""
    value = _tensor(item)
    if k is None:
        return _edge_call(graph, "flip.default", (item, [dim]), value.flip([dim]))
    return _edge_call(graph, "slice_copy.Tensor", (item, dim, 0, k), value.narrow(dim, 0, k).clone())


def _replace(program: ExportedProgram, old: torch.fx.Node, new: torch.fx.Node) -> None:
    """Every use of `old` reads `new`, the program's output list included."""
    old.replace_all_uses_with(new)
    for spec in program.graph_signature.output_specs:
        if getattr(spec.arg, "name", None) == old.name:
            spec.arg.name = new.name


def _ignored_argument_call(node: torch.fx.Node) -> Optional[tuple[int, Optional[int]]]:
    """(dim, k) of a sort/argsort with descending=True or a topk with largest=False, whose
    input has a static shape; k is None for sort/argsort."""
    if node.op != "call_function" or ignored_argument(node) is None:
        return None
    source = _tensor(node.args[0])
    if source is None or not _static(source.shape) or source.dim() == 0:
        return None
    name = op_name(node.target)
    dim = argument(node, "dim", -1) % source.dim()
    return (dim, argument(node, "k", None)) if name == "aten.topk.default" else (dim, None)


def ignored_arguments_made_explicit(program: ExportedProgram) -> int:
    """Stock 1.5.1's MLX sort, argsort and topk handlers ignore `descending` and `largest`
    (a descending sort came back ascending, silently). Each such call becomes an ascending
    sort, flipped (sort, argsort) or cut to its first k (topk with largest=False, whose
    result torch gives smallest first), which those handlers lower right. Returns how
    many calls changed; what is left (a symbolic shape) `support.ignored_argument` refuses."""
    import operator

    if not fixes.on("ignored_arguments_made_explicit"):
        return 0
    graph = program.graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        found = _ignored_argument_call(node)
        if found is None:
            continue
        dim, k = found
        with graph.inserting_before(node):
            values, indices = _ascending_sort(graph, node.args[0], dim)
            if op_name(node.target) == "aten.argsort.default":
                _replace(program, node, _reorder(graph, indices, dim, k))
            else:
                for user in list(node.users):
                    if user.target is not operator.getitem:
                        continue
                    with graph.inserting_before(user):
                        item = (values, indices)[user.args[1]]
                        _replace(program, user, _reorder(graph, item, dim, k))
        for user in list(node.users):
            graph.erase_node(user)
        graph.erase_node(node)
        changed += 1
    if changed:
        graph.eliminate_dead_code()
    return _finished(program, changed, "sort/topk calls made ascending, then flipped or cut")


_ARG_REDUCTIONS = ("aten.argmax.default", "aten.argmin.default")


def _flat_arg_reduction_keeping_dims(node: torch.fx.Node) -> bool:
    """An argmax/argmin over all elements (dim None) with keepdim=True."""
    if node.op != "call_function" or op_name(node.target) not in _ARG_REDUCTIONS:
        return False
    return argument(node, "dim", None) is None and bool(argument(node, "keepdim", False))


def kept_dims_made_explicit(program: ExportedProgram) -> int:
    """torch's argmax/argmin with dim=None and keepdim=True give a tensor of the input's rank
    with every size 1; stock 1.5.1's MLX handlers flatten and reduce and ignore keepdim when
    dim is None, so the result came back 0-d. Each such call becomes the same call with
    keepdim=False viewed as [1] * rank, which those handlers lower right. Returns how many
    calls changed."""
    graph = program.graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        if not _flat_arg_reduction_keeping_dims(node):
            continue
        value = _tensor(node)
        with graph.inserting_before(node):
            flat = _edge_call(graph, op_name(node.target).removeprefix("aten."), (node.args[0],), value.reshape(()))
            ones = [1] * value.dim()
            view = _edge_call(graph, "view_copy.default", (flat, ones), value)
        _replace(program, node, view)
        graph.erase_node(node)
        changed += 1
    return _finished(program, changed, "argmax/argmin over all elements given their kept dimensions explicitly")


_NEAREST = ("aten.upsample_nearest2d.default", "aten.upsample_nearest2d.vec")


def _nearest_scales(node: torch.fx.Node) -> Optional[list]:
    """[scale_h, scale_w] an upsample_nearest2d passes (None where it passes none), or None."""
    if node.op != "call_function" or op_name(node.target) not in _NEAREST:
        return None
    if op_name(node.target).endswith(".vec"):
        factors = node.args[2] if len(node.args) > 2 else None
        return list(factors) if factors is not None else None
    return [node.args[2] if len(node.args) > 2 else None, node.args[3] if len(node.args) > 3 else None]


def torch_nearest_scales(source: torch.Tensor, result: torch.Tensor, scales: list) -> list:
    """The scales torch's nearest kernel acts on: where the output is the input's size or
    twice it, torch copies or halves the index and ignores the scale; out / in says the same."""
    acted = []
    for scale, size_in, size_out in zip(scales, source.shape[-2:], result.shape[-2:]):
        static = isinstance(size_in, int) and isinstance(size_out, int)
        same_or_double = static and size_out in (size_in, 2 * size_in)
        acted.append(size_out / size_in if same_or_double and scale is not None else scale)
    return acted


def nearest_scales_torch_ignores_dropped(program: ExportedProgram) -> int:
    """torch's upsample_nearest2d ignores its scales along an axis whose output is the input's
    size or twice it (it copies or halves the index), and uses 1 / scale on the others. Stock
    1.5.1's MLX handler always steps by 1 / scale: `interpolate(x, scale_factor=2.2)` of a
    3x3 x (output 6x6) read rows 0,0,0,1,1,2 where torch reads 0,0,1,1,2,2, silently. On
    those axes the scale becomes out / in, which steps the same as torch. Returns how many
    calls changed."""
    if not fixes.on("nearest_scales_torch_ignores_dropped"):
        return 0
    graph = program.graph_module.graph
    changed = 0
    for node in graph.nodes:
        scales = _nearest_scales(node)
        source, result = _tensor(node.args[0]) if scales else None, _tensor(node)
        if source is None or result is None:
            continue
        acted = torch_nearest_scales(source, result, scales)
        if acted == scales:
            continue
        if op_name(node.target).endswith(".vec"):
            node.args = (node.args[0], node.args[1], acted)
        else:
            node.args = (*node.args[:2], *acted)
        changed += 1
    return _finished(program, changed, "nearest upsamplings given the scales torch acts on")


# Arguments that change no value (eager CPU ignores them), by op: their position in the schema.
_NO_VALUE_ARGUMENTS = {
    "aten.copy.default": ("non_blocking", 2),
    "aten.expand_copy.default": ("implicit", 2),
}


def no_value_arguments_dropped(program: ExportedProgram) -> int:
    """`copy(non_blocking=True)` and `expand(implicit=True)` compute what the defaults do, but
    stock 1.5.1's MLX copy and expand handlers accept two arguments only and refuse them, and
    ExecuTorch's CPU kernels fail at run time ("non_blocking == false", "implicit == false").
    Each such call is given without the argument, which both lower right. Returns how many
    calls changed."""
    graph = program.graph_module.graph
    changed = 0
    for node in graph.nodes:
        found = _NO_VALUE_ARGUMENTS.get(op_name(node.target)) if node.op == "call_function" else None
        if found is None:
            continue
        name, position = found
        if len(node.args) <= position and name not in node.kwargs:
            continue
        node.args = node.args[:position]
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != name}
        changed += 1
    return _finished(program, changed, "copy/expand calls given without arguments that change no value")


_CLAMPS = ("aten.clamp.default", "aten.clamp.Tensor")


def clamp_input_cast_to_result(program: ExportedProgram) -> int:
    """torch clamps an integer tensor by float bounds in the promoted dtype
    (`clamp(int32 x, min=0.5)` is float32 with 0.5 where x < 1); stock 1.5.1's MLX clamp
    handler casts the bounds to the input's dtype instead (0.5 became 0, silently). Each
    clamp whose result dtype differs from its input's clamps the input cast to that dtype
    first, which that handler lowers right. Returns how many calls changed."""
    if not fixes.on("clamp_input_cast_to_result"):
        return 0
    graph = program.graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or op_name(node.target) not in _CLAMPS:
            continue
        source, result = _tensor(node.args[0]), _tensor(node)
        if source is None or result is None or source.dtype == result.dtype:
            continue
        with graph.inserting_before(node):
            node.args = (_cast(graph, node.args[0], result.dtype), *node.args[1:])
        changed += 1
    return _finished(program, changed, "clamps given their input in the result's dtype")


def rms_norm_epsilon_made_explicit(program: ExportedProgram) -> int:
    """torch's `rms_norm(..., eps=None)` adds `torch.finfo(x.dtype).eps` (1.19e-7 for float32);
    stock 1.5.1's MLX rms_norm handler adds 1e-5 instead, which moves every row whose mean square
    is small (rows of magnitude 1e-3 come out 5 % small, silently). Each such call is given
    torch's epsilon explicitly. Returns how many calls changed."""
    if not fixes.on("rms_norm_epsilon_made_explicit"):
        return 0
    changed = 0
    for node in program.graph_module.graph.nodes:
        if node.op != "call_function" or op_name(node.target) != "aten.rms_norm.default":
            continue
        source = _tensor(node.args[0])
        if source is None or argument(node, "eps", None) is not None or not source.is_floating_point():
            continue
        weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        node.args = (node.args[0], node.args[1], weight, torch.finfo(source.dtype).eps)
        node.kwargs = {}
        changed += 1
    return _finished(program, changed, "rms_norm calls given torch's default epsilon")


def selects_from_data_dependent_sizes_sliced(program: ExportedProgram) -> int:
    """Stock 1.5.1's MLX select handler emits a take, and MLX refuses a take from an array with no
    elements ("[take] Cannot do a non-empty take from an array with zero elements"): a column of
    `nonzero(mask)` threw where the mask was all False. A select from a tensor whose size depends
    on the data becomes a slice of one position and a squeeze, which MLX computes on an empty
    array too. Returns how many calls changed."""
    graph = program.graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or op_name(node.target) != "aten.select_copy.int":
            continue
        source, index = _tensor(node.args[0]), node.args[2]
        if source is None or _static(source.shape) or not isinstance(index, int):
            continue
        dim = node.args[1] % source.dim()
        if index < 0:
            if not isinstance(source.shape[dim], int):
                continue
            index += source.shape[dim]
        with graph.inserting_before(node):
            sliced = _edge_call(graph, "slice_copy.Tensor", (node.args[0], dim, index, index + 1),
                                source.narrow(dim, index, 1).clone())
            squeezed = _edge_call(graph, "squeeze_copy.dims", (sliced, [dim]), _tensor(node))
        _replace(program, node, squeezed)
        graph.erase_node(node)
        changed += 1
    return _finished(program, changed, "selects from data-dependent sizes made slices")


def _assertions_alone_read(node: torch.fx.Node) -> set[torch.fx.Node] | None:
    """What reads tensor `node`, when that is only assertions about it (through its sizes and
    comparisons of them, nothing else); else None."""
    reading, pending = set(), list(node.users)
    while pending:
        user = pending.pop()
        if user in reading:
            continue
        if user.op != "call_function" or isinstance(user.meta.get("val"), torch.Tensor):
            return None  # read by real computation, or returned
        reading.add(user)
        pending += user.users
    about_it_alone = all(source is node or source in reading for user in reading for source in user.all_input_nodes)
    asserted = any(op_name(user.target) == "aten._assert_scalar.default" for user in reading)
    return reading if about_it_alone and asserted else None


def assertions_dropped(program: ExportedProgram) -> int:
    """No ExecuTorch program runs export's size assertions: stock 1.5.1's MLX handler for
    aten._assert_scalar emits nothing, and to_executorch removes every one left on the CPU.
    A tensor that only assertions about it read is computed for nothing, yet it can keep an
    op our rules refuse in the program: Gemma 3's `x[mask].numel() == n` check left a
    run-time bool index on the CPU (`support.boolean_index`) whose result crossed into the
    payload unread, where stock's builder drops it as dead. Such a tensor goes before the
    support check, with its assertions and what then nothing reads. Assertions that also
    read other values stay: they bound a symbol's range (`torch._check(n <= y.shape[0])` for
    `y[:n]`), which the program's verifier needs. Returns how many tensors went."""
    graph = program.graph_module.graph
    dropped = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        reading = _assertions_alone_read(node)
        if reading is None:
            continue
        for gone in [n for n in graph.nodes if n in reading][::-1]:
            graph.erase_node(gone)
        graph.erase_node(node)
        dropped += 1
    if dropped:
        graph.eliminate_dead_code()
    return _finished(program, dropped, "tensors only assertions read dropped, with those assertions")


DEQUANTIZE = "torchao.dequantize_affine.default"
# Node meta key: why the weight a node reads is stored dequantized (float) for MLX.
FLOAT_WEIGHT = "mlx_float_weight"
# The group sizes stock 1.5.1 packs a quantized weight's rows in (`mlx_affine_group_size`).
MLX_GROUP_SIZES = (16, 32, 64, 128)


class QuantizedLayout(NamedTuple):
    """What a torchao.dequantize_affine reads: values of `bits` bits in rows of `row`
    elements, one scale per `group` of them along axis `axis`."""

    bits: int
    group: int
    row: int
    axis: int


def quantized_layout(node: torch.fx.Node) -> QuantizedLayout:
    qdata, block_size, _scale, _zero_point, _dtype, quant_min, quant_max = node.args[:7]
    axis, group = next(((i, d) for i, d in enumerate(block_size) if d != 1), (len(block_size) - 1, 1))
    return QuantizedLayout((quant_max - quant_min + 1).bit_length() - 1, group, _tensor(qdata).shape[axis], axis)


def quantized_layout_mlx_refuses(node: torch.fx.Node) -> Optional[str]:
    """Why MLX cannot hold the weight a torchao.dequantize_affine reads in its own packed format
    (None when it can). Stock 1.5.1 (`parse_dequant_node`, `to_mlx_qparams`) packs int8 values
    of 2, 4, 5, 6 or 8 bits into whole 32-bit words, one scale per group of 16, 32, 64 or 128
    along one axis; a coarser group is split into such groups, so one of them must divide it."""
    dtype, block_size = node.args[4], node.args[1]
    if dtype != torch.int8:
        return f"its values are {str(dtype).removeprefix('torch.')}, and MLX's format is made from int8 values"
    if sum(d != 1 for d in block_size) != 1:
        return f"it has blocks of {list(block_size)}, and MLX groups along one axis only"
    layout = quantized_layout(node)
    if layout.bits not in (2, 4, 5, 6, 8):
        return f"it has {layout.bits}-bit values, and MLX packs 2, 4, 5, 6 or 8 bits"
    if not any(layout.group % size == 0 for size in MLX_GROUP_SIZES):
        return (
            f"it has groups of {layout.group} elements, and MLX's groups are "
            f"{', '.join(map(str, MLX_GROUP_SIZES))} elements: none of them divides {layout.group}"
        )
    if (layout.row * layout.bits) % 32:
        return f"its rows of {layout.row} {layout.bits}-bit values do not fill whole 32-bit words"
    return None


def _constant_values(program: ExportedProgram) -> dict[torch.fx.Node, torch.Tensor]:
    specs = constant_placeholders(program)
    values = {}
    for node in program.graph.nodes:
        spec = specs.get(node.name) if node.op == "placeholder" else None
        if spec is not None:
            store = program.state_dict if spec.target in program.state_dict else program.constants
            if isinstance(store.get(spec.target), torch.Tensor):
                values[node] = store[spec.target]
    return values


def _drop_unread_constants(program: ExportedProgram, nodes: set[torch.fx.Node]) -> None:
    """Remove those of `nodes` (constant placeholders) nothing reads any more, with their data."""
    specs = constant_placeholders(program)
    for node in nodes:
        if node.users or node.name not in specs:
            continue
        spec = specs[node.name]
        program.graph_signature.input_specs.remove(spec)
        program.state_dict.pop(spec.target, None)
        program.constants.pop(spec.target, None)
        program.graph.erase_node(node)


def quantized_weights_mlx_cannot_hold_dequantized(program: ExportedProgram) -> int:
    """A weight quantized in a layout MLX cannot hold (`quantized_layout_mlx_refuses`: a row of
    40 quantized per channel) left its torchao.dequantize_affine to the CPU, where the
    ExecuTorch runtime has no kernel for it. Such a weight is dequantized here, once, into a
    float constant (the values the eager quantized model computes with), so its readers run on
    MLX in float; each reader's `FLOAT_WEIGHT` meta says why. Returns how many weights."""
    from torch._guards import detect_fake_mode

    graph = program.graph_module.graph
    values = _constant_values(program)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes])
    made: dict[str, torch.fx.Node] = {}  # one float weight per dequantize call (a tied weight has two)
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or op_name(node.target) != DEQUANTIZE:
            continue
        why = quantized_layout_mlx_refuses(node)
        read = node.all_input_nodes
        if why is None or not all(source in values for source in read):
            continue
        call = repr((node.args, node.kwargs))
        if call not in made:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
            with torch.no_grad():
                dequantized = aten_overload(node.target)(*args, **kwargs).contiguous()
            made[call] = lift_constant(program, f"{node.args[0].name}_dequantized", dequantized, fake_mode)
        weight = made[call]
        layout = quantized_layout(node)
        for user in node.users:
            user.meta[FLOAT_WEIGHT] = (
                f"its {layout.bits}-bit weight in groups of {layout.group} is stored dequantized, in float, "
                f"because MLX cannot hold it quantized: {why}"
            )
        node.replace_all_uses_with(weight)
        graph.erase_node(node)
        _drop_unread_constants(program, set(read))
        changed += 1
    return _finished(program, changed, "quantized weights MLX cannot hold stored dequantized")


# Every rewrite, in the order the backend runs them before its support check.
REWRITES: tuple[Callable[[ExportedProgram], int], ...] = (
    assertions_dropped,
    copy_source_like_destination,
    ignored_arguments_made_explicit,
    kept_dims_made_explicit,
    nearest_scales_torch_ignores_dropped,
    no_value_arguments_dropped,
    clamp_input_cast_to_result,
    rms_norm_epsilon_made_explicit,
    selects_from_data_dependent_sizes_sliced,
    quantized_weights_mlx_cannot_hold_dequantized,
)
