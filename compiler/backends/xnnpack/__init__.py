"""The XNNPACK backend: ExecuTorch's XNNPACK delegate, which the pip runtime includes."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch
from torch.export import ExportedProgram

from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir.backend.canonical_partitioners.config_partitioner import format_target_name
from executorch.exir.backend.utils import WhyNoPartition

from compiler.backends.base import Backend, BackendPartition, KeepWhole
from compiler.backends.xnnpack import moves, quantized, rules
from compiler.ir.graph import DELEGATION_TAG
from compiler.ir.targets import DYNAMIC, PER_CHANNEL
from compiler.models.llm_ops import LLAMA
from compiler.ir.placement import DELEGATED_REASON
from compiler.ir.private_api import (
    exir_pass_checks_skipped,
    partition_merges_checked_by_bits,
    partition_search_lookups_memoized,
    preprocess_copies_share_tensors,
    unchanged_graphs_not_retraced,
)

_XNNPACK_LOGGER = "executorch.backends.xnnpack"


class _WhyCollector(logging.Handler):
    """Keeps the reasons XNNPACK's partitioner configs log for nodes they refuse."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.reasons: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        why = record.msg
        if isinstance(why, WhyNoPartition) and why.node is not None:
            self.reasons.setdefault(why.node.name, f"XNNPACK's partitioner refused it: {why.reason}")


@contextlib.contextmanager
def _collect_refusals() -> Iterator[_WhyCollector]:
    logger = logging.getLogger(_XNNPACK_LOGGER)
    collector = _WhyCollector()
    saved = (logger.level, logger.propagate)
    logger.addHandler(collector)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # the debug records are for us, not the user's console
    try:
        yield collector
    finally:
        logger.removeHandler(collector)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


class XnnpackBackend(Backend):
    """Options are those of `XnnpackPartitioner` (configs, config_precisions, per_op_mode, ...)."""

    name = "xnnpack"
    folds_decomposed_constants = True
    refusal_rules = rules.RULES
    llm_ops = LLAMA
    llm_ops_where = "called on the CPU beside the delegate"

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        # XnnpackPartitioner passes its **kwargs to every partitioner config, which reads these.
        return ("configs", "config_precisions", "per_op_mode", "verbose", "force_non_static_weights_for_f32_linear", "enable_bf16")

    def __init__(self, **partitioner_options) -> None:
        self.partitioner = XnnpackPartitioner(**partitioner_options)
        rules.refuse_in_configs(self.partitioner)  # what stock's visitors lower wrongly

    @classmethod
    def pt2e_quantizer(cls, scheme, granularity: str):
        from compiler.backends.xnnpack.quantizer import pt2e_quantizer

        return pt2e_quantizer(granularity == PER_CHANNEL, scheme.activations == DYNAMIC)

    @classmethod
    def why_layer_stays_float(cls, scheme, columns: int, one_dimensional_input: bool) -> str | None:
        if scheme.weight_bits == 4 and columns % 32:
            return f"{columns} input features: XNNPACK's 4-bit kernels take rows of a multiple of 32"
        if scheme.activations == DYNAMIC and one_dimensional_input:
            return "its input is 1-D: XNNPACK's dynamically quantized GEMM takes rows of a batch"
        return None

    def keep_whole(self, program: ExportedProgram) -> KeepWhole:
        ops, node_filter = self.partitioner.ops_to_not_decompose(program)
        return KeepWhole(frozenset(ops), node_filter)

    def dry_run_needed(self, program: ExportedProgram, kept: list[torch.fx.Node]) -> str | None:
        return None  # the keep-whole filter is the very check XNNPACK's partitioner takes nodes by

    def partition(self, program: ExportedProgram) -> BackendPartition:
        rules.refuse_eight_bit_groups(program)  # stock's lowering would assert
        dequantized_here = rules.dequantize_with_plain_ops(program)  # stock would drop their scales
        rules.tanh_gelu_as_plain_ops(program)  # stock would compute the exact GELU
        rules.hardtanh_bounds_spelled_out(program)  # stock would fail on hardtanh(x, min_val)
        moves.move_into_xnnpack(program)  # CPU ops between delegated ones, in ops XNNPACK takes
        refused = rules.refused_nodes(program)
        # Stock's search, with its check that two partitions can merge made in time that does
        # not grow with the program (the same answers).
        with _collect_refusals() as collector, partition_merges_checked_by_bits(), partition_search_lookups_memoized():
            result = self.partitioner.partition(program)
        copies = rules.copies_leaving_the_delegate(program)
        delegated = quantized.delegated_reasons(program)
        for node in program.graph.nodes:
            if node.name in delegated and node.meta.get(DELEGATION_TAG):
                node.meta[DELEGATED_REASON] = delegated[node.name]
        reasons = {**collector.reasons, **refused, **dequantized_here, **copies}
        return BackendPartition(dict(result.partition_tags), reasons)

    def lowering(self, dependency_checks: bool = False) -> contextlib.AbstractContextManager[None]:
        """Each partition's program for XNNPACK's preprocess shares the partition's weights
        (`preprocess_copies_share_tensors`: its passes put what they compute in new tensors), a
        pass that changed nothing does not retrace the partition (`unchanged_graphs_not_retraced`),
        and unless `dependency_checks`, no check of the whole partition by ExecuTorch's pass
        manager before and after each of XNNPACK's passes (`exir_pass_checks_skipped`)."""
        stack = contextlib.ExitStack()
        stack.enter_context(preprocess_copies_share_tensors())
        # Most of XNNPACK's passes change nothing in a given partition but retrace it anyway.
        stack.enter_context(unchanged_graphs_not_retraced())
        if not dependency_checks:
            stack.enter_context(exir_pass_checks_skipped())
        return stack

    def default_cpu_reason(self, node: torch.fx.Node) -> str:
        target = format_target_name(getattr(node.target, "__name__", str(node.target)))
        if target in self.partitioner.target_partitioner_configs:
            return f"XNNPACK takes {target}, but not with these dtypes, shapes or arguments"
        return f"XNNPACK does not support {target}"
