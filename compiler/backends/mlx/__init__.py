"""The MLX backend: ExecuTorch's MLX delegate, for Apple silicon.

The ExecuTorch runtime's MLX delegate runs only on Apple silicon; here its
payloads run in the reference executor (`compiler/running/reference.py`, with
`compiler.backends.mlx.reference`: the `mlx` package on the Linux CPU). The delegate's generated schema files are made on first use
(see `generated.py`), which is why ExecuTorch's MLX modules are imported when
a backend is built, not when this package is.
"""

from __future__ import annotations

import contextlib

import re

import torch
from torch.export import ExportedProgram

from compiler.backends.base import Backend, BackendPartition, KeepWhole
from compiler.backends.mlx import handlers, rewrites, support
from compiler.backends.node_rules import first_refusal
from compiler.backends.mlx.generated import MLXSetupError, ensure_generated
from compiler.backends.mlx.llm_ops import MLX
from compiler.ir import dynamic
from compiler.ir.dialect import op_name
from compiler.ir.graph import DELEGATION_TAG, state_not_starting_at_zero
from compiler.ir.placement import DELEGATED_REASON
from compiler.ir.mapped import SPILL_TENSOR_BYTES, ReleaseEvery, is_mapped, mapped_bytes, spilled
from compiler.ir.private_api import (
    mlx_include_sym_size_nodes,
    mlx_made_constants_moved,
    mlx_unsupported_reasons,
    preprocess_copies_share_tensors,
)

# The delegate id ExecuTorch records in the program for MLX payloads.
DELEGATE_ID = "MLXBackend"


# "<function _h at 0x..> failed for <EdgeOpOverload: aten.x.default>: schema = ... -> T: why"
_HANDLER_FAILED = (
    re.compile(
        r"<function ([\w.<>]+) at 0x[0-9a-f]+> failed for <EdgeOpOverload: ([^>]+)>: "
        r"schema = .*? -> (?:\([^)]*\)|[\w\[\]?]+): (.+)$"
    ),
    re.compile(r"<function (\w+) at 0x[0-9a-f]+> failed for ([\w.]+): (.+)$"),
)


def _one_line(reason: str) -> str:
    """ExecuTorch's MLX reasons can hold a handler's whole traceback and the op's schema;
    keep the first line, and of a handler's failure only which handler refused what and why."""
    line = reason.strip().splitlines()[0] if reason.strip() else reason
    for pattern in _HANDLER_FAILED:
        found = pattern.match(line)
        if found:
            handler, op, why = found.groups()
            return f"{handler} refused {op}: {why}"
    return line


def _refusal(program: ExportedProgram, node: torch.fx.Node, why: str) -> str:
    """Stock's reason for refusing a node, in one line; a handler that took a dynamic size as a
    number (a guard `dynamic.guards_refused` stopped) is said so, naming the dimension, and a
    refusal of a dynamic argument (`require_static_int`: '... with dynamic size ...') names it."""
    line = _one_line(why)
    symbols = dynamic.refused_guard_symbols(why)
    if not symbols:
        read = (dynamic.symbols_read(node) or dynamic.symbols_named(line)) if "dynamic" in line else []
        given = f" (dynamic size {dynamic.describe_sizes(program.graph, read)})" if read else ""
        return f"MLX's partitioner refused it: {line}{given}"
    sizes = dynamic.describe_sizes(program.graph, symbols)
    return (
        f"MLX's {line.split(' refused ')[0]} takes the dynamic size {sizes} as a number, which would fix "
        "it at the example's size for the whole program; on the CPU it stays dynamic"
    )


def _keep_initialized_state_on_cpu(program: ExportedProgram) -> None:
    """The MLX runtime starts the state it owns at zeros (the payload holds no initial
    value), so a mutable buffer that starts otherwise stays CPU-owned: MLX reads it as
    an input and returns its new value, and the program carries its initial value."""
    for placeholder, _ in state_not_starting_at_zero(program):
        placeholder.meta.pop("delegation_tag", None)


def _say_how_quantized_weights_run(program: ExportedProgram) -> None:
    """Each delegated node that dequantizes a quantized weight or reads one gets, as its
    placement reason, how MLX computes it: on the packed weight, or in float and why."""
    how = support.quantized_weight_reasons(program)
    for node in program.graph.nodes:
        if node.name in how and node.meta.get(DELEGATION_TAG):
            node.meta[DELEGATED_REASON] = how[node.name]


class MLXBackend(Backend):
    """Options are those of ExecuTorch's `MLXPartitioner` (compile_specs)."""

    name = "mlx"
    refusal_rules = support.RULES
    llm_ops = MLX

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return ("compile_specs",)  # MLXPartitioner's

    @classmethod
    def weight_only_config(cls, bits: int, group_size: int | None):
        """MLX's own LLM export picks weight scales by HQQ (zero points stay zero): the same
        choice gives the same weights as its programs, bit for bit."""
        from compiler.backends.mlx.hqq import HqqWeightOnlyConfig

        return HqqWeightOnlyConfig(bits, group_size)

    @classmethod
    def stock_partitioners(cls, options=None) -> list:
        ensure_generated()  # stock's partitioner imports the files ExecuTorch's wheel lacks
        return super().stock_partitioners(options)

    def __init__(self, **partitioner_options) -> None:
        ensure_generated()
        from executorch.backends.mlx.partitioner import MLXPartitioner

        handlers.register_item_of_a_tensor()
        handlers.register_index_put()
        self.partitioner = MLXPartitioner(**partitioner_options)

    def keep_whole(self, program: ExportedProgram) -> KeepWhole:
        with support.symbolic_floats_hidden(program), support.nested_lists_hidden(program), \
                dynamic.guards_refused(program), handlers.dynamic_sizes_inferred():
            ops, _ = self.partitioner.ops_to_not_decompose(program)
        # An op one of our rules sends to the CPU must not be kept whole for MLX
        # (the same rule stock applies to the nodes its own check declines).
        refused = {
            n.target for n in program.graph.nodes if first_refusal(n, support.RULES)
        }
        return KeepWhole(frozenset(op for op in ops if op not in refused))

    def partition(self, program: ExportedProgram) -> BackendPartition:
        from executorch.backends.mlx.partitioner import MLXOperatorSupport
        from executorch.exir.backend.canonical_partitioners.pattern_op_partitioner import (
            generate_partitions_from_list_of_nodes,
        )
        from executorch.exir.backend.utils import tag_constant_data, tag_mutated_buffer

        for rewrite in rewrites.REWRITES:
            rewrite(program)
        # Stock MLXPartitioner.partition() refuses to run outside
        # to_edge_transform_and_lower; its pieces are what it would run.
        with support.symbolic_floats_hidden(program), support.nested_lists_hidden(program), \
                dynamic.guards_refused(program), handlers.dynamic_sizes_inferred():
            stock = MLXOperatorSupport(program, self.partitioner.delegation_spec.compile_specs)
        guarded = support.GuardedSupport(stock)
        found = generate_partitions_from_list_of_nodes(program.graph_module, op_support=guarded)
        found = mlx_include_sym_size_nodes(self.partitioner, program.graph_module, found)
        # A partition of size arithmetic and its asserts only (what follows a `nonzero` left on the
        # CPU) computes no tensor and gives no output: to_backend cannot fuse it ("Cannot determine
        # insertion point ... orig_outputs is empty"), and the CPU runs it anyway.
        found = [p for p in found if any(isinstance(n.meta.get("val"), torch.Tensor) for n in p.nodes)]

        partitions = {}
        for partition in found:
            tag = f"mlx_{partition.id}"
            for node in partition.nodes:
                node.meta["delegation_tag"] = tag
            partitions[tag] = self.partitioner.delegation_spec
        if partitions:
            tag_constant_data(program)
            tag_mutated_buffer(program)
            _keep_initialized_state_on_cpu(program)

        _say_how_quantized_weights_run(program)
        reasons = dict(guarded.refused)
        for node, why in mlx_unsupported_reasons(stock).items():
            reasons.setdefault(node.name, _refusal(program, node, why))
        return BackendPartition(partitions, reasons)

    def lowering(self, dependency_checks: bool = False):
        """Stock's handlers run again in `preprocess`, with the same replacements as in the search;
        the program MLX's preprocess gets shares the partition's weights, which it only reads
        into the named data (`preprocess_copies_share_tensors`); the constants its builder makes
        of mapped weights (packed codes) are written to mapped files as they are made, and the
        pages it read of the mapped weights dropped as it goes (`_made_constant_moved`)."""
        stack = contextlib.ExitStack()
        stack.enter_context(handlers.dynamic_sizes_inferred())
        stack.enter_context(preprocess_copies_share_tensors())
        stack.enter_context(mlx_made_constants_moved(_made_constant_moved(ReleaseEvery())))
        return stack

    def default_cpu_reason(self, node: torch.fx.Node) -> str:
        return f"MLX's partitioner left {op_name(node.target)} out of every delegate (it gave no reason)"


def _made_constant_moved(release: ReleaseEvery):
    """A large constant the builder made while mapped weights are about (a real-size model read
    from its checkpoint), written to a mapped file: a 4-bit 8B model's packed codes are 4.5 GB."""

    def move(tensor: torch.Tensor) -> torch.Tensor:
        size = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
        if size < SPILL_TENSOR_BYTES or not mapped_bytes() or is_mapped(tensor):
            return tensor
        release.count(size)
        return spilled([tensor])[0]

    return move


__all__ = ["DELEGATE_ID", "MLXBackend", "MLXSetupError"]
