"""Split constants: one placeholder per delegation-tag group that reads a constant.

When a partitioner takes a constant over (tags its placeholder) while ops
outside that delegate also read it, each side needs its own placeholder. Users
are grouped by tag: the CPU users keep the original (untagged), each delegate
group gets exactly one copy tagged for it, shared by the whole group. Stock
ExecuTorch 1.5.1 instead copies per user and gives every copy the original's
target, so the constant is listed twice in the graph signature; and it misses
users that read the constant inside a list (the indices of `aten.index`).

Copies share the original's tensor (no extra memory here) under a new target
of their own. Mutable buffers are never copied: a copy would leave one side
reading stale state, so that case is left to the verifier, which names the ops.
"""

from __future__ import annotations

import collections

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputSpec, TensorArgument

from compiler.ir.artifacts import PartitionedProgram, SplitProgram
from compiler.ir.graph import DELEGATION_TAG, constant_placeholders, copy_program, mutated_buffer_targets
from compiler.ir.placement import PlacementPlan
from compiler.stages.base import Stage, StageContext
from compiler.reporting.report import Metric, counted

CPU = None


def _groups(node: torch.fx.Node) -> dict[str | None, list[torch.fx.Node]]:
    groups: dict[str | None, list[torch.fx.Node]] = collections.defaultdict(list)
    for user in node.users:
        groups[user.meta.get(DELEGATION_TAG)].append(user)
    return groups


def needs_split(ep: ExportedProgram) -> list[torch.fx.Node]:
    """Tagged constant placeholders read by nodes with another tag (or none)."""
    constants = constant_placeholders(ep)
    mutated = mutated_buffer_targets(ep)
    return [
        node
        for node in ep.graph.nodes
        if node.op == "placeholder"
        and node.name in constants
        and constants[node.name].target not in mutated
        and node.meta.get(DELEGATION_TAG)
        and set(_groups(node)) != {node.meta[DELEGATION_TAG]}
    ]


def _store(ep: ExportedProgram, spec: InputSpec) -> dict:
    return ep.state_dict if spec.target in ep.state_dict else ep.constants


def split_constants(ep: ExportedProgram) -> int:
    """Split every shared tagged constant of `ep` in place; returns the copies made."""
    specs = ep.graph_signature.input_specs
    copies = 0
    for node in needs_split(ep):
        spec = next(s for s in specs if s.arg.name == node.name)
        groups = _groups(node)
        keeper = CPU if CPU in groups else node.meta[DELEGATION_TAG]
        if keeper not in groups:
            keeper = next(iter(groups))
        node.meta.pop(DELEGATION_TAG, None)
        if keeper is not CPU:
            node.meta[DELEGATION_TAG] = keeper
        index = specs.index(spec)
        anchor = node
        for number, (tag, users) in enumerate(t for t in groups.items() if t[0] != keeper):
            name, target = f"{node.name}_copy_{number}", f"{spec.target}_copy_{number}"
            store = _store(ep, spec)
            store[target] = store[spec.target]
            with ep.graph.inserting_after(anchor):
                copy = ep.graph.placeholder(name)
            copy.meta.update(node.meta)
            copy.meta[DELEGATION_TAG] = tag
            for user in users:
                user.replace_input_with(node, copy)  # also inside list arguments
            index += 1
            specs.insert(index, InputSpec(spec.kind, TensorArgument(copy.name), target, spec.persistent))
            anchor = copy
            copies += 1
    if copies:
        ep.graph_module.recompile()
    return copies


class SplitConstants(Stage, takes=PartitionedProgram, returns=SplitProgram):
    metrics = (
        Metric("copies", "count", lambda n: f"made {counted(n, 'constant copy', 'constant copies')} for delegates "
               "sharing one" if n else "no constant copies needed"),
    )

    def apply(self, partitioned: PartitionedProgram, ctx: StageContext) -> SplitProgram:
        if not needs_split(partitioned.program):
            ctx.metrics["copies"] = 0
            return SplitProgram(
                partitioned.program, partitioned.plan, partitioned.preserved_ops, partitioned.refused_input_dtypes
            )
        program = copy_program(partitioned.program)
        ctx.metrics["copies"] = split_constants(program)
        reasons = {p.node: p.reason for p in partitioned.plan.cpu_nodes}
        plan = PlacementPlan.from_tagged_program(program, partitioned.plan.partitions, reasons)
        return SplitProgram(program, plan, partitioned.preserved_ops, partitioned.refused_input_dtypes)
