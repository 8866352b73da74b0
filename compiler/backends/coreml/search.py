"""The Core ML partition search: ExecuTorch's capability search under our rules.

Node rules are asked once per node. The capability search then proposes
partitions; partition rules (a refused dtype or a size expression read from outside, a refused dtype
leaving Core ML, a partition with no inputs below iOS 18) may refuse more nodes,
and the search runs again until no partition breaks one. Refusing a node that
reads a uint8 tensor also refuses, in the same round, the ops that read its
uint8 result: a camera frame's chain up to the conversion to float leaves Core
ML in one round, not one round per op. Once tagged, a partition that reads a dynamic
size computed elsewhere gets its own copy of it (`copy_size_reads`).
"""

from __future__ import annotations

import operator
from typing import Collection, Mapping

import attrs
import torch
from torch.export import ExportedProgram
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.operator_support import OperatorSupportBase

from compiler.backends.coreml import quantized, rules
from compiler.ir.graph import CONSTANT_INPUT_KINDS, DELEGATION_TAG


class _Supported(OperatorSupportBase):
    def __init__(self, refused: Mapping[torch.fx.Node, str]) -> None:
        super().__init__()
        self.refused = refused

    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        return node.op == "call_function" and node not in self.refused


@attrs.frozen
class SearchResult:
    partitions: tuple[Partition, ...]
    # Node -> why it is not in a Core ML partition.
    refused: Mapping[torch.fx.Node, str]


def _taken_over_inputs(program: ExportedProgram, constants: bool, buffers: bool) -> set[str]:
    """Placeholders that become part of a partition rather than its inputs."""
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    names = set()
    for spec in program.graph_signature.input_specs:
        if spec.kind not in CONSTANT_INPUT_KINDS:
            continue
        is_state = spec.target in mutated
        if (is_state and buffers) or (not is_state and constants):
            names.add(spec.arg.name)
    return names


def _has_tensor_inputs(partition: Partition, taken_over: set[str]) -> bool:
    inside = partition.nodes
    for node in inside:
        for source in node.all_input_nodes:
            if source in inside or not isinstance(source.meta.get("val"), torch.Tensor):
                continue
            if source.op == "placeholder" and source.name in taken_over:
                if all(user in inside for user in source.users):
                    continue
            return True
    return False


def _owned_constants(inside: Collection[torch.fx.Node], taken_over: set[str]) -> set[torch.fx.Node]:
    """The taken-over constants only quantized ops of `inside` read: coremltools makes MIL
    consts of them (a quantized weight's int8 data), so reading one is no model input. Other
    ops keep refusing int8 and uint8 constants: few MIL ops take those dtypes."""
    return {
        source
        for node in inside
        if quantized.node_need(node)
        for source in node.all_input_nodes
        if source.op == "placeholder" and source.name in taken_over
        and all(u in inside and quantized.node_need(u) for u in source.users)
    }


def _propagate_refused_dtypes(new: dict[torch.fx.Node, str], refused: Mapping[torch.fx.Node, str]) -> None:
    """Ops reading a refused-dtype result of a CPU op would read it from outside too."""
    work = list(new)
    while work:
        node = work.pop()
        if not rules.tensor_dtypes(node) & rules.REFUSED_DTYPES:
            continue
        for user in node.users:
            if user.op != "call_function" or user in refused or user in new:
                continue
            if user.target is operator.getitem:
                new[user] = "tuple access"  # replaced by the producer's placement; never reported
                work.append(user)
                continue
            reason = rules.reads_refused_dtype(user, ())
            if reason:
                new[user] = reason
                work.append(user)


def search(
    program: ExportedProgram,
    ctx: rules.RuleContext,
    take_over_constant_data: bool,
    take_over_mutable_buffer: bool,
) -> SearchResult:
    graph_module = program.graph_module
    refused: dict[torch.fx.Node, str] = {}
    for node in graph_module.graph.nodes:
        reason = rules.refusal(node, ctx)
        if reason:
            refused[node] = reason
    taken_over = _taken_over_inputs(program, take_over_constant_data, take_over_mutable_buffer)

    while True:
        partitions = CapabilityBasedPartitioner(
            graph_module, _Supported(refused), allows_single_node_partition=True
        ).propose_partitions()
        new: dict[torch.fx.Node, str] = {}
        for partition in partitions:
            inside = partition.nodes
            owned = {*inside, *_owned_constants(inside, taken_over)}
            for node in inside:
                if node.target is operator.getitem:
                    continue
                reason = (
                    rules.reads_refused_dtype(node, owned)
                    or rules.reads_size_expression(node, inside)
                    or rules.reads_float16_before_ios16(node, inside, ctx)
                    or rules.gives_refused_dtype(node, inside)
                )
                if reason:
                    new[node] = reason
            if not ctx.ios18 and not any(n in new for n in inside):
                if not _has_tensor_inputs(partition, taken_over):
                    new.update({n: rules.NO_INPUTS_REASON for n in inside})
        if not new:
            return SearchResult(tuple(partitions), refused)
        _propagate_refused_dtypes(new, refused)
        refused.update(new)


def tag(result: SearchResult) -> list[str]:
    """Write the delegation tags of `result` into the graph; returns the tags used."""
    tags = []
    for partition in result.partitions:
        tag_name = f"tag{partition.id}"
        tags.append(tag_name)
        for node in partition.nodes:
            node.meta[DELEGATION_TAG] = tag_name
    return tags


def tag_constants(program: ExportedProgram) -> None:
    """Give a constant the tag of its users when all of them share one tag.

    A constant also read on the CPU (or by another partition) stays untagged and
    is passed to the delegate as an input.
    """
    mutated = set(program.graph_signature.buffers_to_mutate.values())
    constants = {
        spec.arg.name
        for spec in program.graph_signature.input_specs
        if spec.kind in CONSTANT_INPUT_KINDS and spec.target not in mutated
    }
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in constants or not node.users:
            continue
        user_tags = {user.meta.get(DELEGATION_TAG) for user in node.users}
        if len(user_tags) == 1 and None not in user_tags:
            node.meta[DELEGATION_TAG] = user_tags.pop()


def _size_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.meta.get("val"), torch.SymInt)


def _size_in(node: torch.fx.Node, tag: str, copies: dict[tuple[torch.fx.Node, str], torch.fx.Node]) -> torch.fx.Node:
    """`node`, a size computed from tensors (`sym_size`, arithmetic on sizes), as computed inside
    partition `tag`: itself if it is there, else a copy reading the same tensors."""
    if node.meta.get(DELEGATION_TAG) == tag or not _size_node(node):
        return node
    if (node, tag) not in copies:
        inputs = {a: _size_in(a, tag, copies) for a in node.all_input_nodes}
        with node.graph.inserting_after(node):
            copy = node.graph.node_copy(node, lambda a: inputs[a])
        copy.meta[DELEGATION_TAG] = tag
        copies[node, tag] = copy
    return copies[node, tag]


def copy_size_reads(program: ExportedProgram) -> int:
    """Give each partition its own copy of the sizes it reads from outside (a dynamic size read
    in another partition or on the CPU): a delegate takes tensors only, and coremltools failed
    at lower ("Placeholder val must be a tensor or fake tensor, but got SymInt"). The copy reads
    the size off the tensor it came from, which the partition takes as an input. Returns how
    many copies were made; a size no partition reads from elsewhere any more is removed."""
    copies: dict[tuple[torch.fx.Node, str], torch.fx.Node] = {}
    for node in list(program.graph.nodes):
        if not _size_node(node):
            continue
        for user in list(node.users):
            tag = user.meta.get(DELEGATION_TAG)
            if tag is not None and tag != node.meta.get(DELEGATION_TAG):
                user.replace_input_with(node, _size_in(node, tag, copies))
    for node in reversed(list(program.graph.nodes)):
        if _size_node(node) and not node.users:
            program.graph.erase_node(node)
    return len(copies)
