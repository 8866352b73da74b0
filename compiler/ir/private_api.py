"""Every private ExecuTorch and coremltools name this project uses, and nothing else.

A private name is one a package does not promise to keep: an import from a module
path with an underscored part (`executorch.exir.dialects._ops`), an underscored
name (`_default_decomposition_table`), or an underscored attribute read or written
on one of their objects (`EdgeOpOverload._op`), closure inspection included. Each
entry below says why no public way does, and the version it was checked against:
executorch 1.5.1 and coremltools 9.0, as pinned in pyproject.toml. When either is
upgraded, this file is what to re-check; `tests/test_private_api.py` fails when a
private name of either package is used anywhere else in `compiler/`.

Every import is made on first use, inside the entry that needs it: coremltools is
imported only when a Core ML entry is asked for, and MLX's generated modules (made
on first use by `compiler.backends.mlx.generated`) only when an MLX entry is. This
module imports nothing from `compiler`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Iterator, Sequence

if TYPE_CHECKING:
    import torch
    from torch.export import ExportedProgram

EXECUTORCH_VERSION = "1.5.1"
COREMLTOOLS_VERSION = "9.0"


# --- Edge dialect ops (executorch.exir.dialects) ------------------------------------


@functools.cache
def edge_ops() -> Any:
    """ExecuTorch's Edge op namespace (`edge_ops().edge.aten.add.Tensor`), which has no public
    path: only `executorch.exir.dialects._ops.ops`. Checked against executorch 1.5.1."""
    from executorch.exir.dialects._ops import ops

    return ops


@functools.cache
def edge_op_class() -> type:
    """`EdgeOpOverload`, the class of Edge op targets, defined only in the private
    `executorch.exir.dialects.edge._ops`. Checked against executorch 1.5.1."""
    from executorch.exir.dialects.edge._ops import EdgeOpOverload

    return EdgeOpOverload


def is_edge_op(target: Any) -> bool:
    """Whether `target` is an Edge op (an `EdgeOpOverload`). Checked against executorch 1.5.1."""
    return isinstance(target, edge_op_class())


def aten_overload(target: Any) -> Any:
    """The ATen OpOverload an Edge op stands for (its private `_op`: EdgeOpOverload has no
    public accessor); any other target unchanged. Checked against executorch 1.5.1."""
    return target._op if isinstance(target, edge_op_class()) else target


# --- ExecuTorch's prim ops and operator tables --------------------------------------


def executorch_sym_ops() -> set:
    """The symbolic-int helpers ExecuTorch emits as prim ops (`_EXECUTORCH_SYM_OPS`, Edge and
    ATen spellings); no public list exists. Checked against executorch 1.5.1."""
    from executorch.exir.passes.executorch_prim_ops_registry import _EXECUTORCH_SYM_OPS

    return _EXECUTORCH_SYM_OPS


def python_sym_ops_to_executorch() -> dict:
    """Python's symbolic-int operators (`operator.add`...) -> the ExecuTorch prim op they are
    emitted as (`_PYTHON_SYM_OPS_TO_EXECUTORCH_SYM_OPS`); no public mapping exists.
    Checked against executorch 1.5.1."""
    from executorch.exir.passes.executorch_prim_ops_registry import _PYTHON_SYM_OPS_TO_EXECUTORCH_SYM_OPS

    return _PYTHON_SYM_OPS_TO_EXECUTORCH_SYM_OPS


def native_schema(schema: Any) -> Any:
    """torchgen's FunctionSchema of a torch schema, or None for a TorchScript-only one: what
    `to_executorch` matches out variants by (`_pybind_schema_to_native_schema`).
    Checked against executorch 1.5.1."""
    from executorch.exir.operator.convert import _pybind_schema_to_native_schema

    return _pybind_schema_to_native_schema(schema)


def registered_operator_names() -> list[str]:
    """The operator names the runtime linked into this process registers (`aten::add.out`...);
    the pybindings' only way to ask is `_get_operator_names`. Checked against executorch 1.5.1."""
    from executorch.extension.pybindings.portable_lib import _get_operator_names

    return list(_get_operator_names())


def quant_primitives() -> list:
    """The quantize/dequantize ops ExecuTorch keeps whole when it decomposes
    (`executorch.exir.operator.util._QUANT_PRIMITIVES`). Checked against executorch 1.5.1."""
    from executorch.exir.operator.util import _QUANT_PRIMITIVES

    return _QUANT_PRIMITIVES


# --- Decomposition (executorch.exir.tracer, executorch.exir.program._program) -------


def default_decomposition_table() -> dict:
    """A fresh copy of the decomposition table `to_edge` uses (`_default_decomposition_table`);
    ours starts from it so the result matches stock. Checked against executorch 1.5.1."""
    from executorch.exir.tracer import _default_decomposition_table

    return _default_decomposition_table()


def ops_allowed_not_to_decompose(ops: list) -> list:
    """Of `ops`, those ExecuTorch lets a partitioner keep whole (stock's filter behind
    `ops_to_not_decompose`, `_remove_invalid_ops_for_not_decompose`).
    Checked against executorch 1.5.1."""
    from executorch.exir.program._program import _remove_invalid_ops_for_not_decompose

    return _remove_invalid_ops_for_not_decompose(ops)


def no_decompose_op(op: Any) -> Any:
    """`op`'s twin in ExecuTorch's no-decompose namespace (registered on first use), which
    `run_decompositions` leaves alone: how stock keeps ops whole
    (`_register_no_decomp_op`, `aten_op_to_transform_op`). Checked against executorch 1.5.1."""
    from executorch.exir.program._program import _register_no_decomp_op, aten_op_to_transform_op

    _register_no_decomp_op(op)
    return aten_op_to_transform_op[op]


def no_decompose_original(op: Any) -> Any:
    """The ATen op whose no-decompose twin `op` is, or None (`aten_op_to_transform_op`). By name:
    a program decomposed since may hold the twin looked up again, as another object.
    Checked against executorch 1.5.1."""
    from executorch.exir.program._program import aten_op_to_transform_op

    name = str(op)
    return next((aten_op for aten_op, twin in aten_op_to_transform_op.items() if str(twin) == name), None)


def restore_no_decompose_ops(program: ExportedProgram) -> None:
    """Turn the no-decompose twins in `program` back into their ATen ops, in place
    (`_restore_transformed_ops_to_aten_ops`). Checked against executorch 1.5.1."""
    from executorch.exir.program._program import _restore_transformed_ops_to_aten_ops

    _restore_transformed_ops_to_aten_ops(program)


# --- Edge conversion (executorch.exir.program._program) ----------------------------


def aten_to_edge_passes(config: Any) -> tuple[list, list]:
    """The passes `to_edge` runs before and after replacing ATen ops with Edge ops
    (`_get_aten_to_edge_passes`); we run the same ones, skipping those that cannot apply.
    Checked against executorch 1.5.1."""
    from executorch.exir.program._program import _get_aten_to_edge_passes

    return _get_aten_to_edge_passes(config)


def updated_graph_signature(signature: Any, graph_module: Any) -> Any:
    """`signature` with its names updated to `graph_module`'s after passes renamed nodes
    (`_get_updated_graph_signature`, in the private `executorch.exir._program_utils`).
    Checked against executorch 1.5.1."""
    from executorch.exir.program._program import _get_updated_graph_signature

    return _get_updated_graph_signature(signature, graph_module)


def transform(program: ExportedProgram, *passes: Any) -> ExportedProgram:
    """`program` with ExecuTorch's pass manager running `passes` on it, as `to_edge` does
    (`_transform`). Checked against executorch 1.5.1."""
    from executorch.exir.program._program import _transform

    return _transform(program, *passes)


def lift_constant_tensor_pass(program: ExportedProgram) -> ExportedProgram:
    """Lift the tensor constants left in the graph into the signature, as `to_edge` does;
    defined only in the private `executorch.exir.program._program`. Checked against executorch 1.5.1."""
    from executorch.exir.program._program import lift_constant_tensor_pass as lift

    return lift(program)


def unwrap_pass(graph_pass: Any) -> Any:
    """The pass object inside the function wrappers of ExecuTorch's pass lists (torch's
    `pass_result_wrapper`, whose only handle on the pass is its closure variable `fn`).
    Checked against executorch 1.5.1."""
    while inspect.isfunction(graph_pass):
        inner = inspect.getclosurevars(graph_pass).nonlocals.get("fn")
        if inner is None:
            break
        graph_pass = inner
    return graph_pass


def set_verifiers(program: ExportedProgram, verifiers: Iterable[Any]) -> None:
    """Give a loaded program back ExecuTorch's Edge verifier with its preserved ops: the
    `verifiers` property refuses to be set, so the private `_verifiers` is written.
    Checked against executorch 1.5.1 (torch 2.13)."""
    program._verifiers = list(verifiers)


@contextlib.contextmanager
def constants_kept(program: ExportedProgram) -> Iterator[None]:
    """While the block runs, `program` holds a copy of its constants table, which it keeps
    afterwards; the table it had is put back. ExecuTorch's `to_backend` lowers a fake copy of
    the program that shares the real one's constants table (`get_fake_program`) and deletes the
    constants each delegate takes from it, so the program given to it would lose them. The
    copy is of the table only: the tensors stay shared. `_constants` is the property's private
    store. Checked against executorch 1.5.1 (torch 2.13)."""
    table = program._constants
    program._constants = dict(table)
    try:
        yield
    finally:
        program._constants = table


def _copied_sharing_tensors(original: Callable) -> Callable:
    """`BackendDetails.copy_exported_program_for_preprocess`, copying the graph and the tables
    but not the tensors in them, in a thread that asks for it."""
    import copy

    import torch

    def call(edge_program: ExportedProgram, compile_specs: list) -> ExportedProgram:
        if not _flag("preprocess_shares_tensors"):
            return original(edge_program, compile_specs)
        tensors = (*edge_program.state_dict.values(), *edge_program.constants.values())
        return copy.deepcopy(edge_program, {id(t): t for t in tensors if isinstance(t, torch.Tensor)})

    return call


@contextlib.contextmanager
def preprocess_copies_share_tensors() -> Iterator[None]:
    """While the block runs, the copy `to_backend` makes of each partition for its backend's
    `preprocess` (`BackendDetails.copy_exported_program_for_preprocess`, a `deepcopy` in case
    preprocess changes the graph) shares the partition's weights in this thread instead of
    cloning every one: for a backend whose preprocess reads the weights and never writes them.
    ExecuTorch's CUDA backend copies its partitions the same way. Checked against executorch 1.5.1."""
    from executorch.exir.backend.backend_details import BackendDetails

    with _replaced(BackendDetails, "copy_exported_program_for_preprocess", _copied_sharing_tensors):
        with _flag_set("preprocess_shares_tensors"):
            yield


# --- Serialized programs (executorch.exir._serialize) ------------------------------


def named_data_store() -> Any:
    """A new ExecuTorch `NamedDataStore` (`executorch.exir._serialize._named_data_store`): the
    only way to make the named data a `LoweredBackendModule` carries into the program it is
    emitted in (stock's Core ML multimethod preprocess stores its multifunction models with it).
    Checked against executorch 1.5.1."""
    from executorch.exir._serialize._named_data_store import NamedDataStore

    return NamedDataStore()


def delegate_named_data(module: Any) -> dict[str, bytes]:
    """The named data a `LoweredBackendModule` carries into its program (`named_data_store_output`:
    the `.pte`'s entries and those bound for a data file), by key. Checked against executorch 1.5.1."""
    store = getattr(module, "named_data_store_output", None)
    if store is None:
        return {}
    entries = dict(store.pte_data or {})
    for file_entries in (store.external_data or {}).values():
        entries.update(file_entries)
    return {key: bytes(store.buffers[entry.buffer_index]) for key, entry in entries.items()}


def deserialize_pte(pte: bytes) -> Any:
    """The flatbuffer contents of a `.pte` (program, named data, mutable data); ExecuTorch's
    only reader is `executorch.exir._serialize._program.deserialize_pte_binary`.
    Checked against executorch 1.5.1."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    return deserialize_pte_binary(bytes(pte))


# --- Delegate calls while ExecuTorch emits (torch._higher_order_ops) ----------------


@contextlib.contextmanager
def delegate_outputs_from_call_sites(graph_module: Any) -> Iterator[None]:
    """While the block runs, a fake-tensor trace of a delegate call in `graph_module` (what
    `to_executorch`'s passes do when they retrace the program) makes its outputs from the
    shapes its call site recorded, instead of torch's fake kernel of `executorch_call_delegate`
    (`call_delegate_cpu`), which unlifts a copy of the delegate's whole original program with
    `ExportedProgram.module()` and interprets every op of it on fake tensors, twice per
    `to_executorch`. A call whose arguments differ in shape, stride or dtype from the recorded
    ones, or whose recorded outputs have symbolic sizes, goes to torch's kernel; so does one
    whose recorded outputs are not what that kernel returns: the original program's user
    outputs (a delegate that takes over a mutable buffer keeps the buffer's new value inside,
    while its call site still recorded it as an output: trusted, the outputs after it shifted
    and the emitted plan read the wrong one). The kernel is
    looked up and swapped in torch's private `registered_hop_fake_fns`; the emit stage runs one
    at a time in a process (the driver's stage lock). Checked against torch 2.13 and
    executorch 1.5.1."""
    import torch
    from torch._higher_order_ops.executorch_call_delegate import executorch_call_delegate
    from torch._higher_order_ops.utils import registered_hop_fake_fns
    from torch.utils import _pytree as pytree

    def metadata(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.stride(), value.dtype, value.device)
        return value

    def static(value: Any) -> bool:
        """No symbol in it: comparing a symbol with another guards on it, which a data-dependent
        size refuses (a delegate given `u8` at lowering and `u10` at emit's retrace)."""
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return False
        return not isinstance(value, torch.Tensor) or not any(
            isinstance(n, torch.SymInt) for n in (*value.shape, *value.stride())
        )

    def kernel_outputs(original: Any) -> list | None:
        """The values torch's kernel returns for a delegate: what its original program's
        unlifted module returns, its user outputs (None when one is not a traced tensor)."""
        from torch.export.graph_signature import OutputKind

        values = original.graph.output_node().args[0]
        specs = original.graph_signature.output_specs
        user = [v for v, spec in zip(values, specs) if spec.kind == OutputKind.USER_OUTPUT]
        if not all(isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor) for v in user):
            return None
        return [v.meta["val"] for v in user]

    recorded: dict[int, tuple[Any, Any]] = {}
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.target is not executorch_call_delegate or "val" not in node.meta:
                continue
            arguments = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in node.args[1:]]
            outputs = node.meta["val"]
            lowered = getattr(module, node.args[0].target)
            returned = kernel_outputs(lowered.original_module)
            if (
                all(static(v) for v in pytree.tree_leaves((arguments, outputs)))
                and returned is not None
                and [metadata(v) for v in pytree.tree_leaves(outputs)] == [metadata(v) for v in returned]
            ):
                recorded[id(lowered)] = (pytree.tree_map(metadata, arguments), outputs)

    stock = registered_hop_fake_fns[executorch_call_delegate]

    def from_call_site(lowered_module: Any, *args: Any) -> Any:
        known = recorded.get(id(lowered_module))
        given = list(args)
        if known is None or not all(static(v) for v in pytree.tree_leaves(given)) or pytree.tree_map(metadata, given) != known[0]:
            return stock(lowered_module, *args)
        return pytree.tree_map_only(
            torch.Tensor,
            lambda v: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device),
            known[1],
        )

    registered_hop_fake_fns[executorch_call_delegate] = from_call_site
    try:
        yield
    finally:
        registered_hop_fake_fns[executorch_call_delegate] = stock


# --- MLX delegate (executorch.backends.mlx) ----------------------------------------

# The flatc bindings of the MLX schema: private, and generated on first use (see
# compiler/backends/mlx/generated.py). Checked against executorch 1.5.1.
MLX_GENERATED_PACKAGE = "executorch.backends.mlx.serialization._generated.mlx_delegate"


def mlx_generated_class(name: str) -> type:
    """The flatc-generated class `name` of the MLX schema (`MLXGraph`, `OpNode`, a node table);
    imported only when asked, as the files may not exist before. Checked against executorch 1.5.1."""
    return getattr(importlib.import_module(f"{MLX_GENERATED_PACKAGE}.{name}"), name)


def mlx_op_node_fields() -> dict:
    """Each MLX node type's fields and their kinds, from the generated
    `executorch.backends.mlx._generated_inspector` (no public schema reader).
    Checked against executorch 1.5.1."""
    from executorch.backends.mlx._generated_inspector import OP_NODE_FIELDS

    return OP_NODE_FIELDS


def fixup_flatc_imports(generator: Any) -> None:
    """Run the MLX generator's import fix-up on the flatc output (`_fixup_flatc_imports`), the
    step of stock `generate.py` we need without the C++ ones. Checked against executorch 1.5.1."""
    generator._fixup_flatc_imports()


def mlx_include_sym_size_nodes(partitioner: Any, graph_module: Any, partitions: list) -> list:
    """`partitions` with the sym_size nodes feeding them added, the last step of stock
    `MLXPartitioner.partition()`, which we run piece by piece
    (`_include_sym_size_nodes_in_partitions`). Checked against executorch 1.5.1."""
    return partitioner._include_sym_size_nodes_in_partitions(graph_module, partitions)


def mlx_index_handler() -> Callable:
    """Stock's MLX handler of `aten.index.Tensor` (`executorch.backends.mlx.ops._index_handler`),
    which `compiler.backends.mlx.handlers` runs under its own. Checked against executorch 1.5.1."""
    from executorch.backends.mlx.ops import _index_handler

    return _index_handler


def mlx_unsupported_reasons(operator_support: Any) -> dict:
    """Node -> why `MLXOperatorSupport` refused it (its private `_unsupported_reason`, the only
    record of the reasons). Checked against executorch 1.5.1."""
    return operator_support._unsupported_reason


def mlx_nearest_source_indices(in_size: int, out_size: int, scale: float | None) -> torch.Tensor:
    """The source index of each output position of stock's MLX upsample_nearest2d handler, to
    compare with torch's (`executorch.backends.mlx.ops._nearest_source_indices`).
    Checked against executorch 1.5.1."""
    from executorch.backends.mlx.ops import _nearest_source_indices

    return _nearest_source_indices(in_size, out_size, scale)


@contextlib.contextmanager
def mlx_made_constants_moved(move: Callable[[Any], Any]) -> Iterator[None]:
    """While the block runs, each constant MLX's program builder makes while it lowers (a
    quantized weight packed, a scale regrouped: `MLXProgramBuilder.make_or_get_constant`, kept
    in its `extra_constants` until the named data is written) is `move(tensor)` instead, in
    every thread. Checked against executorch 1.5.1."""
    from executorch.backends.mlx.builder.program_builder import MLXProgramBuilder

    def wrap(original: Callable) -> Callable:
        def call(builder: Any, name: str, tensor: Any) -> Any:
            return original(builder, name, move(tensor))

        return call

    with _replaced(MLXProgramBuilder, "make_or_get_constant", wrap):
        yield


def mlx_build_recording_nodes(program: ExportedProgram, named_data_key_prefix: str) -> tuple[Any, dict, dict]:
    """Build `program` with stock's `MLXProgramBuilder` as `MLXBackend.preprocess` does, and
    record what the payload does not keep: (the MLXGraph, node name -> how many main-chain
    instructions had been emitted when the builder marked the node handled (its handler's are
    those since the previous mark), node name -> its final tensor slot). Which node a slot and
    an instruction stand for exists only inside the builder: its per-node hook
    (`_mark_node_supported`), its chains (`_chains`, main first) and its slot numbering
    (`_slot_to_final_tid`) are private. Checked against executorch 1.5.1."""
    from executorch.backends.mlx.builder.program_builder import MLXProgramBuilder
    from executorch.backends.mlx.builder.slot_manager import IdType

    marked: dict[str, int] = {}

    class RecordingBuilder(MLXProgramBuilder):
        def _mark_node_supported(self, node, *, handler=None):
            marked.setdefault(node.name, len(self._chains[0]))
            super()._mark_node_supported(node, handler=handler)

    builder = RecordingBuilder(program, named_data_key_prefix=named_data_key_prefix)
    graph = builder.build()
    tids = {}
    for name, slot in builder.slot_manager.name_to_slot.items():
        if isinstance(slot, tuple) or slot.id_type != IdType.Tensor:
            continue
        tid = builder._slot_to_final_tid.get(slot)
        if tid is not None:
            tids[name] = tid
    return graph, marked, tids


# --- Core ML delegate (executorch.backends.apple.coreml) and coremltools -----------


def coreml_unsupported_op_targets() -> frozenset:
    """The ops ExecuTorch's Core ML partitioner refuses by name (`_UNSUPPORTED_OP_TARGETS`),
    which our rules report with a reason. Checked against executorch 1.5.1."""
    from executorch.backends.apple.coreml.partition import coreml_partitioner

    return coreml_partitioner._UNSUPPORTED_OP_TARGETS


# The pattern makers of ExecuTorch's CoreMLQuantizer (`_coreml_quantizer_utils`).
_COREML_PATTERN_MAKERS = (
    "get_conv_pattern", "get_conv_bn_pattern", "get_linear_pattern", "get_linear_bn_pattern",
    "get_binary_op_act_pattern",
)


def _made_once(maker: Callable) -> Callable:
    """`maker` memoized, handing out a copy: the matcher rewrites the pattern graph it is given
    (it splits its output tuple)."""
    import copy

    made = functools.cache(maker)

    @functools.wraps(maker)
    def copy_of_made(*args: Any, **kwargs: Any) -> Any:
        return copy.deepcopy(made(*args, **kwargs))

    copy_of_made.made_once = True
    return copy_of_made


def coreml_pattern_graphs_made_once() -> None:
    """ExecuTorch's CoreMLQuantizer builds the graph of each pattern it matches (a conv, linear
    or binary op with each activation it may fuse) with torch.export at every `annotate`: 2.5-8
    minutes a call on a real model. A pattern's graph depends only on its maker's arguments: the
    makers are memoized where the quantizer looks them up (`_coreml_quantizer_utils`, a private
    module; a maker another version lacks is left alone). Checked against executorch 1.5.1."""
    from executorch.backends.apple.coreml.quantizer import _coreml_quantizer_utils as makers

    for name in _COREML_PATTERN_MAKERS:
        maker = getattr(makers, name, None)
        if maker is not None and not getattr(maker, "made_once", False):
            setattr(makers, name, _made_once(maker))


# The op an annotator's every pattern holds, by the annotator's registered name (its first word
# for the conv, linear and binary families; the pools' and flatten's whole name).
_COREML_ANCHOR_FAMILIES = ("conv", "linear", "add", "mul", "matmul")


def _coreml_anchor(annotator_name: str) -> str:
    first = annotator_name.split("_")[0]
    return first if first in _COREML_ANCHOR_FAMILIES else annotator_name


@contextlib.contextmanager
def coreml_annotators_for(graph: Any) -> Iterator[None]:
    """CoreMLQuantizer's `annotate` runs each of its 24 annotators (`_AnnotationPatternRegistry.
    REGISTRY`), each building its pattern graphs and matching them over the whole model: on a
    250M-parameter LLM the convolution patterns alone took over half its `annotate`, with no
    convolution to find. While the block runs the registry holds only the annotators whose
    anchor op occurs in `graph` (a pattern cannot match without it). Checked against executorch 1.5.1."""
    from executorch.backends.apple.coreml.quantizer._coreml_quantizer import _AnnotationPatternRegistry

    ops = {str(node.target) for node in graph.nodes if node.op == "call_function"}
    registry = _AnnotationPatternRegistry.REGISTRY
    kept = {name: annotator for name, annotator in registry.items()
            if any(_coreml_anchor(name) in op for op in ops)}
    _AnnotationPatternRegistry.REGISTRY = kept
    try:
        yield
    finally:
        _AnnotationPatternRegistry.REGISTRY = registry


def coreml_annotator_names() -> list[str]:
    """The names of the annotators CoreMLQuantizer's `annotate` runs now. Checked against executorch 1.5.1."""
    from executorch.backends.apple.coreml.quantizer._coreml_quantizer import _AnnotationPatternRegistry

    return list(_AnnotationPatternRegistry.REGISTRY)


def coreml_is_arg_min_max_over_flattened_input(node: Any) -> bool:
    """Stock's check for an argmin/argmax over all elements, which Core ML crashes on
    (`_is_arg_min_max_over_flattened_input`). Checked against executorch 1.5.1."""
    from executorch.backends.apple.coreml.partition import coreml_partitioner

    return coreml_partitioner._is_arg_min_max_over_flattened_input(node)


@functools.cache
def _torch_ops_registry() -> Any:
    # Importing ExecuTorch's Core ML compiler registers its converters first.
    import executorch.backends.apple.coreml.compiler  # noqa: F401
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY

    return _TORCH_OPS_REGISTRY


def coreml_converters() -> dict[str, Callable[..., None]]:
    """coremltools' torch-op converters by name, the dict itself (`_TORCH_OPS_REGISTRY
    .name_to_func_mapping`; `register_torch_op` can add but not wrap one).
    Checked against coremltools 9.0."""
    return _torch_ops_registry().name_to_func_mapping


def swap_coreml_converters(mapping: dict[str, Callable[..., None]]) -> dict[str, Callable[..., None]]:
    """Make `mapping` coremltools' converter registry in one attribute store (every lookup
    reads `_TORCH_OPS_REGISTRY.name_to_func_mapping` anew, so no thread sees a mix of two);
    returns the mapping it replaced. Checked against coremltools 9.0."""
    registry = _torch_ops_registry()
    previous, registry.name_to_func_mapping = registry.name_to_func_mapping, mapping
    return previous


@contextlib.contextmanager
def coreml_progress_bars(bar: Callable[..., Any]) -> Iterator[None]:
    """coremltools draws tqdm bars on the terminal while it converts ops (`frontend.torch.ops.
    _tqdm`) and runs its MIL pass pipelines (`mil.passes.pass_pipeline.tqdm`), with no option
    to turn them off or to read their progress; `bar` (tqdm's call signature) stands in for
    both while the block runs. Checked against coremltools 9.0."""
    from coremltools.converters.mil.frontend.torch import ops
    from coremltools.converters.mil.mil.passes import pass_pipeline

    saved = ops._tqdm, pass_pipeline.tqdm
    ops._tqdm = pass_pipeline.tqdm = bar
    try:
        yield
    finally:
        ops._tqdm, pass_pipeline.tqdm = saved


@contextlib.contextmanager
def coreml_conversion_state_reset_on_failure() -> Iterator[None]:
    """coremltools names the MIL ops it builds from process-wide counters (`Builder.name_count`:
    `linear_0`, `cast_1`...) and records the shape symbols it made (`k_used_symbols`), and
    resets both (`converter._reset_conversion_state`) only once a conversion has succeeded: one
    that fails (an `InvalidBlockStateError` mid-pipeline) leaves them counting, and the next
    conversion in the process names its ops differently (`linear_8`), so the same program gives
    another payload. If the block raises, this resets them as a success would.
    Checked against coremltools 9.0."""
    from coremltools.converters.mil.converter import _reset_conversion_state

    try:
        yield
    except BaseException:
        _reset_conversion_state()
        raise


# --- Checks the dependencies repeat (ExecuTorch's to_backend, coremltools) ---------
#
# Each entry makes one dependency check do nothing in the thread that enters it, for the
# duration of the block: a wrapper takes the checking function's place while any thread is
# inside such a block (the first in installs it, the last out puts the original back, also
# on an exception) and calls the original in every thread that did not ask to skip it.

_PATCH_LOCK = threading.Lock()
_patched: dict[tuple[type, str], list] = {}  # (owner, name) -> [the original as stored, users]
_this_thread = threading.local()  # flag name -> how many blocks of this thread set it


def _flag(name: str) -> bool:
    return getattr(_this_thread, name, 0) > 0


@contextlib.contextmanager
def _flag_set(name: str) -> Iterator[None]:
    setattr(_this_thread, name, getattr(_this_thread, name, 0) + 1)
    try:
        yield
    finally:
        setattr(_this_thread, name, getattr(_this_thread, name) - 1)


_DIM_ORDER_USERS = (
    "executorch.exir.tensor", "executorch.exir.tensor_layout", "executorch.exir.emit._emitter",
    "executorch.exir.passes.replace_view_copy_with_view_pass",
)


def _row_major(stride: Sequence[Any]) -> tuple[int, ...]:
    return tuple(range(len(stride)))


_nonzero_users = [0, None]  # blocks inside `nonzero_laid_out_by_row`, and torch's own fake nonzero


@contextlib.contextmanager
def nonzero_laid_out_by_row() -> Iterator[None]:
    """While the block runs, torch's fake `nonzero` gives its result row-major strides. torch
    lays `nonzero`'s (count, ndim) result out by column (strides (1, count)), eager and fake
    alike, and ExecuTorch takes a tensor's dim order from its strides, but the runtime's kernel
    writes the result by row: a reader that honours dim orders then read it transposed
    (`nonzero(mask).contiguous()` off by 10 where the mask is 2-D, silently), a squeeze refused
    it (error 0x12), and `nonzero(mask).float()` failed in to_edge ("Failed to map a given
    dim_order: [1, 0]"). The values are torch's either way; only their layout is the runtime's."""
    import torch
    from torch._subclasses import fake_impls

    key = torch.ops.aten.nonzero.default
    with _PATCH_LOCK:
        if _nonzero_users[0] == 0:
            original = fake_impls.op_implementations_dict[key]

            def by_row(fake_mode: Any, func: Any, arg: Any) -> Any:
                result = original(fake_mode, func, arg)
                return arg.new_empty_strided(tuple(result.shape), (max(arg.dim(), 1), 1), dtype=result.dtype)

            _nonzero_users[1] = original
            fake_impls.op_implementations_dict[key] = by_row
        _nonzero_users[0] += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _nonzero_users[0] -= 1
            if _nonzero_users[0] == 0:
                fake_impls.op_implementations_dict[key] = _nonzero_users[1]


_CIA_LISTERS = ("torch.export.exported_program", "torch.export.decomp_utils")
_cia_users: list = [0, {}, {}]  # blocks inside `decomposable_ops_listed_once`, the originals, the answers
_CIA_ANSWERS_KEPT = 8


def _ops_registered() -> tuple:
    """What `_collect_all_valid_cia_ops`'s answer depends on: the op namespaces and the C++
    dispatcher's CompositeImplicitAutograd kernels (a custom op defined later adds to either)."""
    import torch

    cia = torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")
    return tuple(torch.ops._dir), tuple(sorted(cia))


@contextlib.contextmanager
def decomposable_ops_listed_once() -> Iterator[None]:
    """While the block runs, torch's list of the ops it may decompose or keep
    (`torch._export.utils._collect_all_valid_cia_ops`) is made once per set of registered ops.
    torch remakes it at every `run_decompositions`, twice, by walking every op of every namespace
    (about 65 ms a call; a small compile calls it a dozen times, a test run thousands). The list
    is torch's own, kept across blocks for the namespaces and CompositeImplicitAutograd kernels
    it was made with: a namespace or kernel defined or removed since makes it anew.
    Checked against torch 2.13.0."""
    from torch._export.utils import _collect_all_valid_cia_ops as list_them

    modules = [importlib.import_module(name) for name in _CIA_LISTERS]
    _, originals, answers = _cia_users
    with _PATCH_LOCK:
        if _cia_users[0] == 0:

            def listed_once() -> Any:
                key = _ops_registered()
                if key not in answers:
                    if len(answers) >= _CIA_ANSWERS_KEPT:
                        answers.clear()
                    answers[key] = frozenset(list_them())
                return answers[key]

            for module in modules:
                originals[module] = module._collect_all_valid_cia_ops
                module._collect_all_valid_cia_ops = listed_once
        _cia_users[0] += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _cia_users[0] -= 1
            if _cia_users[0] == 0:
                for module in modules:
                    module._collect_all_valid_cia_ops = originals.pop(module)


@contextlib.contextmanager
def data_dependent_strides_ordered() -> Iterator[None]:
    """While the block runs, ExecuTorch's `exir.tensor.dim_order_from_stride` gives strides it
    cannot order, for holding a data-dependent size, the row-major dim order: stock proves
    `16 < 16*u0` by divisibility but not `16*u0 < 16`'s falsehood, and raises
    `GuardOnDataDependentSymNode` for any program with a tensor of shape (1, u0, 16) (a gather by
    `nonzero`), at emit, on every backend. Row-major is how the runtime's kernels write such a
    tensor: an Edge program's views are copies, and `nonzero`, which torch lays out by column
    (strides (1, u0)), is written by row, so ordering torch's strides would give the kernel that
    reads it (a squeeze) two dim orders it refuses. Stock's answer stands wherever it gives one."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    def wrap(original: Callable) -> Callable:
        def dim_order_from_stride(stride):
            try:
                return original(stride)
            except GuardOnDataDependentSymNode:
                return _row_major(stride)

        return dim_order_from_stride

    with contextlib.ExitStack() as stack:
        for name in _DIM_ORDER_USERS:  # each module that imported the function by name
            stack.enter_context(_replaced(importlib.import_module(name), "dim_order_from_stride", wrap))
        yield


@contextlib.contextmanager
def _replaced(owner: type, name: str, wrap: Callable[[Callable], Callable]) -> Iterator[None]:
    """`owner.name` is `wrap(original)` while any thread is inside a block for it."""
    key = (owner, name)
    with _PATCH_LOCK:
        if key not in _patched:
            stored = owner.__dict__[name]
            wrapper = functools.wraps(getattr(owner, name))(wrap(getattr(owner, name)))
            setattr(owner, name, staticmethod(wrapper) if isinstance(stored, staticmethod) else wrapper)
            _patched[key] = [stored, 0]
        _patched[key][1] += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _patched[key][1] -= 1
            if _patched[key][1] == 0:
                setattr(owner, name, _patched.pop(key)[0])


def _unless_flag(flag: str) -> Callable[[Callable], Callable]:
    """A wrapper that does nothing in a thread where `flag` is set."""

    def wrap(original: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            return None if _flag(flag) else original(*args, **kwargs)

        return call

    return wrap


@contextlib.contextmanager
def exported_program_validation_skipped() -> Iterator[None]:
    """`ExportedProgram._validate` (the verifiers' check of a whole program) does nothing in
    this thread while the block runs. `to_backend` validates the program it is given, the
    program again after lowering, and every ExportedProgram built meanwhile validates itself
    in its constructor (XNNPACK's preprocess builds hundreds); the lower stage's input and
    output are validated by our own verification (`program_validates`), so these repeat it.
    No public way turns them off: ExecuTorch's `validation_disabled()` skips only the check
    that the partitioner left the graph alone. Checked against executorch 1.5.1 (torch 2.13)."""
    from torch.export import ExportedProgram

    with _replaced(ExportedProgram, "_validate", _unless_flag("skip_exported_program_validation")):
        with _flag_set("skip_exported_program_validation"):
            yield


@contextlib.contextmanager
def partitions_fused_without_graph_copies(legalize_in_place: Callable[[Any], bool]) -> Iterator[None]:
    """While the block runs, `to_backend` in this thread fuses each partition into its submodule
    without copying the whole program's graph: its `create_submodule_from_nodes` (executorch.exir.
    lowered_backend_module) calls torch's `legalize_graph` on the whole graph after each fusion,
    which copies every node into a new graph and regenerates the module's Python code, once per
    partition (O(nodes x partitions): 240 partitions of a 2,000-node program). Here the graph is
    put in the same order in place by `legalize_in_place(graph_module)` (`compiler.ir.graph`'s:
    the same node and users order, so the same program; where it returns False, torch's
    `legalize_graph` runs), and its code is generated once, when `to_backend` builds the
    lowered ExportedProgram. `legalize_graph` is looked up in that module's globals on each call;
    no public option skips it (`skip_legalize_graph` is not reachable from `to_backend`, and
    skipping the sort would change the order). Checked against executorch 1.5.1 (torch 2.13)."""
    from executorch.exir import lowered_backend_module

    def wrap(original: Callable) -> Callable:
        def call(graph_module: Any) -> Any:
            if _flag("fuse_without_graph_copies") and legalize_in_place(graph_module):
                return graph_module
            return original(graph_module)

        return call

    with _replaced(lowered_backend_module, "legalize_graph", wrap):
        with _flag_set("fuse_without_graph_copies"):
            yield


def _answered_from_the_signature_read(kind: str) -> Callable[[Callable], Callable]:
    """`is_param`-like: from the names `_signature_read_once_per_tag_list` read, for its program."""

    def wrap(original: Callable) -> Callable:
        def call(program: Any, node: Any) -> bool:
            read = getattr(_this_thread, "signature_read", None)
            if read is None or read[0] is not program:
                return original(program, node)
            return node.name in read[1][kind]

        return call

    return wrap


def _signature_read_once_per_tag_list(original: Callable) -> Callable:
    def call(tagged_graph_module: Any, tag: str, owning_program: Any) -> Any:
        signature = owning_program.graph_signature
        outer = getattr(_this_thread, "signature_read", None)
        _this_thread.signature_read = (
            owning_program,
            {
                "parameters": frozenset(signature.inputs_to_parameters),
                "buffers": frozenset(signature.inputs_to_buffers),
                "constants": frozenset(signature.inputs_to_lifted_tensor_constants),
            },
        )
        try:
            return original(tagged_graph_module, tag, owning_program)
        finally:
            _this_thread.signature_read = outer

    return call


@contextlib.contextmanager
def tagged_constants_found_in_one_signature_read() -> Iterator[None]:
    """While the block runs, `to_backend` in this thread lists each partition's nodes
    (`_get_node_list_with_same_tag`, executorch.exir.backend.backend_api) reading the owning
    program's parameters, buffers and lifted constants once per list, not once per tagged
    placeholder: each `is_param`/`is_buffer`/`is_lifted_tensor_constant` asks the graph
    signature, whose properties build a new dict of every input, so the list cost the
    square of the program's weights (578 at depth 48). Nothing changes the program while
    a list is made. The three are looked up in that module's globals on each call; no
    public hook replaces them. Checked against executorch 1.5.1 (torch 2.13)."""
    from executorch.exir.backend import backend_api

    with contextlib.ExitStack() as stack:
        stack.enter_context(_replaced(backend_api, "_get_node_list_with_same_tag", _signature_read_once_per_tag_list))
        for name, kind in (("is_param", "parameters"), ("is_buffer", "buffers"), ("is_lifted_tensor_constant", "constants")):
            stack.enter_context(_replaced(backend_api, name, _answered_from_the_signature_read(kind)))
        yield


class _ReachabilityBits:
    """Everything downstream of each node as the bits of one integer (bit i: the graph's i-th
    node): n^2 bits, where ExecuTorch's `_DependencyViewer` keeps a Python set of nodes
    downstream and one upstream of every node (n^2 set entries each: 200 MB of a 24-layer
    GPT-2's XNNPACK partition search, more than the rest of the compile held)."""

    def __init__(self, graph_module: Any) -> None:
        self.nodes = list(graph_module.graph.nodes)
        self.bit = {node: 1 << i for i, node in enumerate(self.nodes)}
        self.below: dict[Any, int] = {}
        for node in reversed(self.nodes):
            reach = 0
            for user in node.users:
                reach |= self.bit.get(user, 0) | self.below.get(user, 0)
            self.below[node] = reach

    def mask(self, nodes: Iterable[Any]) -> int:
        bits = 0
        for node in nodes:
            bits |= self.bit.get(node, 0)
        return bits

    def downstreams_of(self, node: Any) -> set:
        reach = self.below.get(node, 0)
        return {n for n, bit in self.bit.items() if reach & bit}


def _merge_check_by_reachability_bits(original: Callable) -> Callable:
    """`GroupBasedPartitioner._can_merge_partitions` with the same answer: two partitions merge
    unless a node outside them that reads one of them has a node of either among everything
    downstream of it, or the merged partition fails torch's `validate_partition`. Stock asks the
    first with `any(n in combined for n in downstream)`, a Python loop over everything downstream
    of the node (the rest of the program) for each pair of partitions; here it is one `&` of the
    node's reachability bits with the two partitions' (`_ReachabilityBits`)."""
    from torch.fx.passes.utils.fuser_utils import validate_partition

    def call(self: Any, p1: Any, p2: Any, partitions_by_id: Any) -> bool:
        viewer = self.dependency_viewer
        if not _flag("partition_merge_by_bits") or not isinstance(viewer, _ReachabilityBits):
            return original(self, p1, p2, partitions_by_id)
        combined = set(partitions_by_id[p1].nodes.keys()).union(partitions_by_id[p2].nodes.keys())
        combined_bits = viewer.mask(combined)
        for node in combined:
            for user in node.users:
                if user not in combined and viewer.below.get(user, 0) & combined_bits:
                    return False
        return validate_partition(list(combined))

    return call


def _reachability_bits_in_threads_that_ask(original: Callable) -> Callable:
    def call(graph_module: Any) -> Any:
        return _ReachabilityBits(graph_module) if _flag("partition_merge_by_bits") else original(graph_module)

    return call


@contextlib.contextmanager
def partition_merges_checked_by_bits() -> Iterator[None]:
    """While the block runs, ExecuTorch's `GroupBasedPartitioner` (XNNPACK's partitioner
    configs use it) decides in this thread whether two partitions can merge as stock does, in
    time that grows with the two partitions, not with the program, and in n^2 bits of memory
    instead of 2 n^2 set entries (`_merge_check_by_reachability_bits`, `_ReachabilityBits`):
    stock's check walks every node downstream for each pair, cubic in the program's size
    (depth-48 transformer: 14 s of the partition stage), over sets quadratic in it. No public
    hook replaces either; the viewer is looked up in the partitioner's module when it is built.
    Checked against executorch 1.5.1."""
    from executorch.exir.backend.canonical_partitioners import group_partitioner

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            _replaced(group_partitioner.GroupBasedPartitioner, "_can_merge_partitions", _merge_check_by_reachability_bits)
        )
        stack.enter_context(_replaced(group_partitioner, "_DependencyViewer", _reachability_bits_in_threads_that_ask))
        stack.enter_context(_flag_set("partition_merge_by_bits"))
        yield


def _memoized_per_search(kind: str, key: Callable[..., Hashable]) -> Callable[[Callable], Callable]:
    """A wrapper answering from this thread's memo of the running partition search, if any."""

    def wrap(original: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            memo = getattr(_this_thread, "partition_search_memo", None)
            if memo is None:
                return original(*args, **kwargs)
            entry = (kind, key(*args, **kwargs))
            if entry not in memo:
                memo[entry] = original(*args, **kwargs)
            return memo[entry]

        return call

    return wrap


def _constant_names(program: Any) -> frozenset:
    signature = program.graph_signature
    return frozenset(
        {*signature.inputs_to_parameters, *signature.inputs_to_buffers, *signature.inputs_to_lifted_tensor_constants}
    )


def _is_constant_data_by_names(original: Callable) -> Callable:
    """`config_partitioner.is_constant_data` as one lookup in the set of the program's constant
    inputs, made once per search: stock's asks the graph signature, whose properties build a
    new dict of every input on each call (1,445 calls for a 24-layer GPT-2)."""

    def call(program: Any, node: Any) -> bool:
        memo = getattr(_this_thread, "partition_search_memo", None)
        if memo is None:
            return original(program, node)
        names = memo.get(("constants", id(program)))
        if names is None:
            names = memo[("constants", id(program))] = _constant_names(program)
        return node.name in names

    return call


@contextlib.contextmanager
def partition_search_lookups_memoized() -> Iterator[None]:
    """While the block runs (one partition search, which tags nodes and changes no graph), two
    whole-program lookups XNNPACK's configs make per candidate node are made once in this thread:
    each linear's `get_source_partitions` over the whole graph (once per matmul: quadratic in the
    program) and `is_constant_data` (`_is_constant_data_by_names`). Checked against executorch 1.5.1."""
    from executorch.backends.xnnpack.partition.config import gemm_configs
    from executorch.exir.backend.canonical_partitioners import config_partitioner

    source_key = lambda graph, wanted, filter_fn=None: (id(graph), tuple(wanted), filter_fn)  # noqa: E731
    with contextlib.ExitStack() as stack:
        stack.enter_context(_replaced(gemm_configs, "get_source_partitions", _memoized_per_search("sources", source_key)))
        stack.enter_context(_replaced(config_partitioner, "is_constant_data", _is_constant_data_by_names))
        outer = getattr(_this_thread, "partition_search_memo", None)
        _this_thread.partition_search_memo = {}
        try:
            yield
        finally:
            _this_thread.partition_search_memo = outer


@contextlib.contextmanager
def exir_pass_checks_skipped() -> Iterator[None]:
    """ExecuTorch's `PassManager.check` (executorch.exir.pass_manager) does nothing in this
    thread while the block runs. The pass manager calls it before and after every pipeline (and
    after every pass when asked): it regenerates the program's Python code, lints the graph and
    validates the program. XNNPACK's `preprocess` runs 17 pipelines of one pass per partition,
    so that is ~34 code generations per partition that nothing reads: a pass that changes the
    graph has the manager regenerate the code itself, the next pass reruns the graph, not its
    code, and serialization reads the graph. Our verification validates the lower stage's input
    and output (the validation inside is skipped by `exported_program_validation_skipped` too).
    Checked against executorch 1.5.1."""
    from executorch.exir.pass_manager import PassManager

    with _replaced(PassManager, "check", _unless_flag("skip_exir_pass_checks")):
        with _flag_set("skip_exir_pass_checks"):
            yield


def _graph_fingerprint(graph_module: Any) -> tuple:
    """What a retrace of the graph module depends on: every node of it and its submodules (op,
    name, target, arguments) with the dtype and shape of its value."""
    import torch

    items: list = []
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            value = node.meta.get("val")
            shown = (value.dtype, tuple(value.shape)) if isinstance(value, torch.Tensor) else repr(value)
            items.append((node.op, node.name, str(node.target), str(node.args), str(node.kwargs), shown))
    return tuple(items)


@functools.cache
def _retrace_hooks() -> frozenset[str]:
    """The methods of ExecuTorch's `ExportPass` through which a pass changes the program as it
    retraces it (every one it defines but `call` and construction)."""
    from executorch.exir.pass_base import ExportPass

    names = set()
    for klass in ExportPass.__mro__:
        if klass is object:
            break
        names |= {name for name, value in vars(klass).items() if callable(value) and not name.startswith("__")}
    return frozenset(names - {"call"})


def _retraces_only(pass_: Any) -> bool:
    """A pass whose `ExportPass.call` only retraces: its class defines none of the retrace's hooks
    (XNNPACK's passes edit the graph in `call`, then retrace it to refresh the values)."""
    from executorch.exir.pass_base import ExportPass

    for klass in type(pass_).__mro__:
        if klass is ExportPass:  # its own hooks retrace without changing
            return True
        if _retrace_hooks() & set(vars(klass)):
            return False
    return False


@contextlib.contextmanager
def unchanged_graphs_not_retraced() -> Iterator[None]:
    """While the block runs, in this thread, `ExportPass.call` returns a graph module unchanged
    (not modified) when the pass only retraces and the graph is the same as a retrace of it made
    in the block left it. XNNPACK's `preprocess` runs 17 passes on each partition; each ends with
    that retrace (a fake-tensor run of every node) whether or not it changed anything, and for a
    transformer layer most change nothing (0.1B Llama, 8da4w: 39 of the lower stage's 42 s were
    these retraces, 2 passes of 17 changed a graph). A retrace of a graph a retrace made is the
    same graph. Checked against executorch 1.5.1."""
    from executorch.exir.pass_base import PassResult, _ExportPassBase

    def wrap(original: Callable) -> Callable:
        def call(self: Any, graph_module: Any) -> Any:
            if not getattr(_this_thread, "retrace_once", False):
                return original(self, graph_module)
            retraced = getattr(graph_module.graph, "_staged_retraced_as", None)
            if retraced is not None and _retraces_only(self) and retraced == _graph_fingerprint(graph_module):
                return PassResult(graph_module, False)
            result = original(self, graph_module)
            result.graph_module.graph._staged_retraced_as = _graph_fingerprint(result.graph_module)
            return result

        return call

    with _replaced(_ExportPassBase, "call", wrap):  # ExportPass inherits it
        with _flag_set("retrace_once"):
            yield


def _inside(flag: str) -> Callable[[Callable], Callable]:
    """A wrapper that sets `flag` in the calling thread while the original runs."""

    def wrap(original: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            with _flag_set(flag):
                return original(*args, **kwargs)

        return call

    return wrap


def _skipped_in_pipelines(original: Callable) -> Callable:
    """`Program.validate`, doing nothing inside a pass pipeline of a thread that skips it."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if _flag("skip_mil_pass_validation") and _flag("in_mil_pass_pipeline"):
            return None
        return original(*args, **kwargs)

    return call


@contextlib.contextmanager
def mil_pass_validation_skipped() -> Iterator[None]:
    """coremltools validates the whole MIL program (`Program.validate`) before each of its three
    pass pipelines and after every one of their ~110 passes (`PassPipelineManager.
    apply_pipeline`), with no option to turn that off; while the block runs, those calls do
    nothing in this thread. coremltools' validations outside the pipelines still run: the
    torch frontend's, when the program is converted (so a conversion that builds an invalid
    op fails there, with coremltools' error), and the MIL backend's (twice) before it
    serializes the program, after the last pipeline. Checked against coremltools 9.0."""
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager
    from coremltools.converters.mil.mil.program import Program

    with contextlib.ExitStack() as stack:
        stack.enter_context(_replaced(PassPipelineManager, "apply_pipeline", _inside("in_mil_pass_pipeline")))
        stack.enter_context(_replaced(Program, "validate", _skipped_in_pipelines))
        stack.enter_context(_flag_set("skip_mil_pass_validation"))
        yield


def _without_nonreplaceable_vars(function: Any) -> bool:
    """Whether no var of the MIL `function` is or reads a nonreplaceable one: no `constexpr_` op
    anywhere in it and every var's set of such vars upstream already empty. Propagating the
    sets through such a function changes nothing."""
    if any(var.nonreplaceable_vars_upstream for var in function.inputs.values()):
        return False
    blocks = [function]
    while blocks:
        block = blocks.pop()
        if any(var.nonreplaceable_vars_upstream for var in block._block_inputs):
            return False
        for op in block.operations:
            if op.op_type.startswith("constexpr_"):
                return False
            if any(var.nonreplaceable_vars_upstream for var in op.outputs or ()):
                return False
            blocks.extend(op.blocks)
    return True


def _propagation_skipped_where_it_changes_nothing(original: Callable) -> Callable:
    """`Block._propagate_nonreplaceable_vars`, returning at once for a function where it would
    change nothing (`_without_nonreplaceable_vars`), in a thread that skips it."""
    from coremltools.converters.mil.mil import Function

    def call(block: Any) -> None:
        if _flag("skip_idle_mil_propagation") and isinstance(block, Function) and _without_nonreplaceable_vars(block):
            return None
        return original(block)

    return call


def _unprinted_unless_logged(original: Callable) -> Callable:
    """A MIL program's or block's `__str__`, a short placeholder inside a pass pipeline of a thread
    that skips it while coremltools does not log at debug level (the text goes only to
    `logger.debug`)."""

    def call(self: Any, *args: Any, **kwargs: Any) -> str:
        if _flag("unprinted_mil_text") and _flag("in_mil_pass_pipeline") and not logging.getLogger(
            "coremltools"
        ).isEnabledFor(logging.DEBUG):
            return f"<{type(self).__name__}: not printed, coremltools does not log at debug level>"
        return original(self, *args, **kwargs)

    return call


@contextlib.contextmanager
def mil_idle_work_skipped() -> Iterator[None]:
    """Two things coremltools does for every one of its ~110 passes that, for most programs, have
    no effect; while the block runs they are skipped in this thread where they have none.
    Each block's exit re-propagates, over the whole function, which vars are downstream of a
    compressed (`constexpr_`) weight (`Block._propagate_nonreplaceable_vars`); a function with no
    such weight and no such var left gets the same empty sets again (20% of a depth-48 Core ML
    lower under cProfile). And each pipeline, and two passes, format the whole program for a
    `logger.debug` call that drops the text unless debug logging is on. Checked against
    coremltools 9.0."""
    from coremltools.converters.mil.mil import Block, Function, Program
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager

    with contextlib.ExitStack() as stack:
        stack.enter_context(_replaced(PassPipelineManager, "apply_pipeline", _inside("in_mil_pass_pipeline")))
        stack.enter_context(_replaced(Block, "_propagate_nonreplaceable_vars", _propagation_skipped_where_it_changes_nothing))
        stack.enter_context(_replaced(Function, "__str__", _unprinted_unless_logged))
        stack.enter_context(_replaced(Program, "__str__", _unprinted_unless_logged))
        stack.enter_context(_flag_set("skip_idle_mil_propagation"))
        stack.enter_context(_flag_set("unprinted_mil_text"))
        yield


# Elements of a weight checked at a time for float16 overflow: 4M float32 values, 16 MB.
_OVERFLOW_PIECE = 1 << 22


def fp16_overflows(value: Any) -> bool:
    """Whether a float32 constant holds a value float16 cannot (65504 < |x| < 1e38; larger ones are
    infinities, whose float16 infinity is right): coremltools' test, a piece of the array at a time."""
    import numpy as np

    flat = np.asarray(value).reshape(-1)
    for start in range(0, flat.size, _OVERFLOW_PIECE):
        piece = np.abs(flat[start : start + _OVERFLOW_PIECE])
        if np.any((piece > 65504) & (piece < 1e38)):
            return True
    return False


@contextlib.contextmanager
def fp16_overflow_checked_in_pieces() -> Iterator[None]:
    """While the block runs, in this thread, coremltools' float16 pass asks `fp16_overflows` whether
    an op's float32 constant would overflow float16. Stock's `FP16ComputePrecision.fp16_overflow`
    takes `np.where` of the whole constant (two int64 index arrays, 16 bytes an element) and copies
    what it indexes: for the 1B Llama's 1 GB embedding table that is 6 GB held at once, and at 0.5B
    31 s of a 108 s compile (cProfile). The answer is the same. Checked against coremltools 9.0."""
    from coremltools.converters.mil.mil.passes.defs.quantization import FP16ComputePrecision

    def wrap(original: Callable) -> Callable:
        def overflow(op: Any) -> bool:
            if not getattr(_this_thread, "fp16_overflow_in_pieces", False):
                return original(op)
            for inputs in op.inputs.values():
                for var in inputs if isinstance(inputs, (list, tuple)) else (inputs,):
                    if (var.op is not None and var.op.op_type == "const" and var.is_tensor_or_scalar_of(dtype="fp32")
                            and fp16_overflows(var.op.val.val)):
                        return True
            return False

        return overflow

    with _replaced(FP16ComputePrecision, "fp16_overflow", wrap):
        with _flag_set("fp16_overflow_in_pieces"):
            yield


@contextlib.contextmanager
def coreml_payloads_rewritten(rewrite: Callable[[Any], Any]) -> Iterator[None]:
    """While the block runs, each `PreprocessResult` ExecuTorch's `CoreMLBackend.preprocess`
    returns in this thread is `rewrite(result)` (other threads get stock's). Stock has no hook after it
    builds a payload and `to_backend` puts `PreprocessResult.processed_bytes` straight into
    the lowered module (whose bytes can be changed after only through its private
    `_processed_bytes`), so a wrapper takes `preprocess`'s place on the class while any
    thread is inside such a block; `to_backend` looks it up there on each call (one method:
    `preprocess_multimethod` falls back to `preprocess`). Checked against executorch 1.5.1."""
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    def wrap(original: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            rewrites = getattr(_this_thread, "coreml_payload_rewrites", None)
            return rewrites[-1](result) if rewrites else result

        return call

    with _replaced(CoreMLBackend, "preprocess", wrap):
        rewrites = _this_thread.__dict__.setdefault("coreml_payload_rewrites", [])
        rewrites.append(rewrite)
        try:
            yield
        finally:
            rewrites.pop()


@contextlib.contextmanager
def coreml_temporary_packages_removed() -> Iterator[None]:
    """While the block runs, each temporary `.mlpackage` folder coremltools writes in this thread
    (an `MLModel` with `is_temp_package`: the converter's output, and the copy its weight
    quantization makes) is deleted once ExecuTorch's `CoreMLBackend.preprocess_model` has made
    the payload from it, and any left at the end of the block. coremltools deletes them only at
    exit (`atexit`): a compile kept every partition's package, its weights included, in the
    temporary folder until it ended, and a process leaving by `os._exit` (a pytest-xdist worker)
    or killed left them there for good. Checked against coremltools 9.0 and executorch 1.5.1."""
    import shutil

    from coremltools.models.model import MLModel
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    def remove_made() -> None:
        made = getattr(_this_thread, "coreml_packages", None) or []
        while made:
            shutil.rmtree(made.pop(), ignore_errors=True)

    def recording(original: Callable) -> Callable:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            made = getattr(_this_thread, "coreml_packages", None)
            if made is not None and getattr(self, "is_temp_package", False):
                made.append(self.package_path)

        return init

    def removing(original: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                remove_made()

        return call

    outer = getattr(_this_thread, "coreml_packages", None)
    with _replaced(MLModel, "__init__", recording), _replaced(CoreMLBackend, "preprocess_model", removing):
        _this_thread.coreml_packages = outer if outer is not None else []
        try:
            yield
        finally:
            if outer is None:
                remove_made()
                _this_thread.coreml_packages = None


# --- Weights written to disk as they are serialised (executorch.exir._serialize) -------


@functools.cache
def _spilled_blob_class() -> type:
    """`FileBackedData` (the private `executorch.exir._serialize._cord`), the one kind of blob other
    than `bytes` that ExecuTorch's named data store and its `.pte` writer take: the writer copies
    it from its file in chunks. Its copies share the file (a program is deep-copied before it is
    serialised; the file never changes). Checked against executorch 1.5.1."""
    from executorch.exir._serialize._cord import FileBackedData

    class SpilledBlob(FileBackedData):
        def __deepcopy__(self, memo: dict) -> "SpilledBlob":
            return self

        def __copy__(self) -> "SpilledBlob":
            return self

        def __bytes__(self) -> bytes:  # what readers of a store's buffers take
            return self.to_bytes()

    return SpilledBlob


def file_blob(path: str, owned: bool = False) -> Any:
    """A file as a blob ExecuTorch's serialiser copies from in chunks; `owned`: removed when the blob
    goes (else it outlives it: the stage cache's weight)."""
    return _spilled_blob_class()(path, cleanup=owned)


def spilled_blob(data: bytes, directory: str) -> Any:
    """`data` written to a file of its own in `directory`, as a blob ExecuTorch's serialiser takes
    in place of the bytes; the file goes when the blob does."""
    import os
    import tempfile

    handle, path = tempfile.mkstemp(prefix="staged-compiler-", suffix=".blob", dir=directory)
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(data)
    except BaseException:
        os.remove(path)
        raise
    return _spilled_blob_class()(path, cleanup=True)


def _spilling(should_spill: Callable[[Any], bool], directory: str, position: int) -> Callable[[Callable], Callable]:
    """A wrapper that hands the original a spilled blob for its `position`th argument (counting
    `self`) where `should_spill` says so."""

    def wrap(original: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            folder = getattr(_this_thread, "spill_directory", None)
            if folder is not None and len(args) > position and should_spill(args[position]):
                spilled_bytes = getattr(_this_thread, "spilled_bytes", None)
                if spilled_bytes is not None:
                    spilled_bytes(len(args[position]))
                args = (*args[:position], spilled_blob(args[position], folder), *args[position + 1 :])
            return original(*args, **kwargs)

        return call

    return wrap


@contextlib.contextmanager
def blobs_spilled(directory: str, at_least: int, spilled_bytes: Callable[[int], None] | None = None) -> Iterator[None]:
    """While the block runs, in this thread, every blob of at least `at_least` bytes that a
    backend's `preprocess` puts in its named data store (XNNPACK's and MLX's weights) and every
    constant ExecuTorch's emitter stores (the CPU's weights, inside the `.pte` or in a `.ptd`)
    is written to a file in `directory` as it is made, and only the file is held: the payloads
    and the program then cost the weights once (the model's), not once per copy. Both owners
    keep a blob as `bytes` and have no hook: `NamedDataStore._add_named_data_to_map` and
    `_Emitter._save_new_const_tensor` take the spilled blob in its place. Checked against
    executorch 1.5.1. `spilled_bytes` is told each spilled blob's size."""
    from executorch.exir._serialize._named_data_store import NamedDataStore
    from executorch.exir.emit._emitter import _Emitter

    def large(data: Any) -> bool:
        return isinstance(data, bytes) and len(data) >= at_least

    with contextlib.ExitStack() as stack:
        stack.enter_context(_replaced(NamedDataStore, "_add_named_data_to_map", _spilling(large, directory, 2)))
        stack.enter_context(_replaced(_Emitter, "_save_new_const_tensor", _spilling(large, directory, 2)))
        previous = getattr(_this_thread, "spill_directory", None), getattr(_this_thread, "spilled_bytes", None)
        _this_thread.spill_directory, _this_thread.spilled_bytes = directory, spilled_bytes
        try:
            yield
        finally:
            _this_thread.spill_directory, _this_thread.spilled_bytes = previous


def pte_program_only(head: bytes) -> Any:
    """The flatbuffer program of a `.pte` (execution plans, operators, delegate ids) without its
    segments, from the file's first bytes (`pte_program_bytes` says how many): a large program's
    weights need not be read to see what it calls. ExecuTorch's reader
    (`_program.deserialize_pte_binary`) reads every segment too. Checked against executorch 1.5.1."""
    from executorch.exir._serialize._program import _flatbuffer_to_program, _get_extended_header

    header = _get_extended_header(head)
    size = header.program_size if header is not None and header.is_valid() else len(head)
    return _flatbuffer_to_program(bytes(head[:size]))


def pte_program_bytes(head: bytes) -> int | None:
    """How many of a `.pte`'s first bytes hold its program flatbuffer, from the extended header in
    its first `head` bytes (None without one: the whole file is the flatbuffer)."""
    from executorch.exir._serialize._program import _get_extended_header

    header = _get_extended_header(head)
    return header.program_size if header is not None and header.is_valid() else None


def pte_segment_base(head: bytes) -> int:
    """Where a `.pte`'s segments start (the offsets in `program.segments` count from there), from
    the extended header in its first bytes; 0 without one. Checked against executorch 1.5.1."""
    from executorch.exir._serialize._program import _get_extended_header

    header = _get_extended_header(head)
    return header.segment_base_offset if header is not None and header.is_valid() else 0


def data_file_index(path: str) -> tuple[int, list[tuple[int, int]], list[tuple[str, int, Any]]]:
    """A data file's (`.ptd`, ExecuTorch's FlatTensor format) index, read from its first bytes only:
    where its segments start, each segment's (offset, size) from there, and each named entry's (key,
    segment, tensor layout). `_deserialize_to_flat_tensor` is private. Checked against executorch 1.5.1."""
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorHeader, _deserialize_to_flat_tensor

    with open(path, "rb") as f:
        head = f.read(64)
        header = FlatTensorHeader.from_bytes(head[8:])
        if not header.is_valid():
            raise ValueError(f"{path!r} is not an ExecuTorch data file (no FlatTensor header)")
        f.seek(0)
        flatbuffer = f.read(header.flatbuffer_offset + header.flatbuffer_size)
    index = _deserialize_to_flat_tensor(flatbuffer)
    segments = [(segment.offset, segment.size) for segment in index.segments]
    named = [(entry.key, entry.segment_index, entry.tensor_layout) for entry in index.named_data]
    return header.segment_base_offset, segments, named


def write_data_file(file: Any, buffers: list, named: list[tuple[str, int, Any]]) -> None:
    """A data file of `buffers` (bytes, or blobs held in files, copied in chunks) and named entries
    (key, buffer, tensor layout), written to the open binary `file` by ExecuTorch's serializer."""
    from executorch.exir._serialize.data_serializer import DataEntry, DataPayload
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    payload = DataPayload(
        buffers=buffers,
        named_data={key: DataEntry(buffer_index=index, alignment=1, tensor_layout=layout) for key, index, layout in named},
    )
    FlatTensorSerializer().serialize(payload).write_to_file(file)


@contextlib.contextmanager
def delegate_data_in_file(programs: Iterable[ExportedProgram], tag: str) -> Iterator[None]:
    """While the block runs, every delegate of `programs` lists the named data its `preprocess`
    stored (XNNPACK's and MLX's weights) as data of the external file `tag` instead of the `.pte`'s;
    the delegates are the lowered artifact's, shared, and get their own lists back after.
    A `LoweredBackendModule`'s named data can be read but not set publicly
    (`_named_data_store_output`), and the backends mark only what a graph annotation asks
    (XNNPACK alone reads one). Checked against executorch 1.5.1."""
    from executorch.exir._serialize._named_data_store import NamedDataStoreOutput
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    delegates = {
        id(module): module
        for program in programs
        for module in program.graph_module.modules()
        if isinstance(module, LoweredBackendModule) and module.named_data_store_output is not None
    }
    saved = [(module, module.named_data_store_output) for module in delegates.values()]
    try:
        for module, output in saved:
            external = {name: dict(entries) for name, entries in output.external_data.items()}
            external.setdefault(tag, {}).update(output.pte_data)
            set_delegate_named_data(module, NamedDataStoreOutput(output.buffers, {}, external))
        yield
    finally:
        for module, output in saved:
            set_delegate_named_data(module, output)


def set_delegate_named_data(module: Any, output: Any) -> None:
    """Give a `LoweredBackendModule` other named data (a `NamedDataStoreOutput`, or None): it has
    no setter, only the private `_named_data_store_output`. Checked against executorch 1.5.1."""
    module._named_data_store_output = output
