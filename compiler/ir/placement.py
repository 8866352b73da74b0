"""Where every node of a partitioned program runs, and why.

The plan is the partition stage's answer, kept beside the tagged program: for
each node its delegation tag and backend, or, for a node left on the CPU, the
reason the backend gave. It is what the placement report prints and what the
lower stage replays.
"""

from __future__ import annotations

import collections
from typing import Mapping

import attrs
from torch.export import ExportedProgram

from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec

from compiler.ir.dialect import op_name
from compiler.ir.graph import DELEGATION_TAG, op_nodes

CPU = "cpu"


@attrs.frozen
class NodePlacement:
    node: str
    op: str
    tag: str | None
    reason: str | None = None  # set for nodes left on the CPU

    @property
    def on_cpu(self) -> bool:
        return self.tag is None


@attrs.frozen
class OpSummary:
    """One row of the placement report: an op, where it runs and why."""

    op: str
    count: int
    where: str
    reason: str


@attrs.frozen
class PlacementPlan:
    nodes: tuple[NodePlacement, ...]
    # Delegation tag -> the backend and compile specs its nodes are lowered with.
    partitions: Mapping[str, DelegationSpec] = attrs.field(factory=dict)
    # Tags of nodes that are not ops: weights and buffers a delegate takes
    # over, and tuple accesses (getitem) inside a partition.
    other_tags: Mapping[str, str] = attrs.field(factory=dict)

    @classmethod
    def from_tagged_program(
        cls,
        ep: ExportedProgram,
        partitions: Mapping[str, DelegationSpec],
        cpu_reasons: Mapping[str, str],
    ) -> "PlacementPlan":
        placements = []
        for node in op_nodes(ep):
            tag = node.meta.get(DELEGATION_TAG)
            reason = None if tag else cpu_reasons[node.name]
            placements.append(NodePlacement(node.name, op_name(node.target), tag, reason))
        placed = {p.node for p in placements}
        other_tags = {
            n.name: n.meta[DELEGATION_TAG]
            for n in ep.graph.nodes
            if n.meta.get(DELEGATION_TAG) and n.name not in placed
        }
        return cls(tuple(placements), dict(partitions), other_tags)

    def where(self, placement: NodePlacement) -> str:
        if placement.tag is None:
            return CPU
        return f"{self.partitions[placement.tag].backend_id}/{placement.tag}"

    @property
    def cpu_nodes(self) -> tuple[NodePlacement, ...]:
        return tuple(p for p in self.nodes if p.on_cpu)

    @property
    def delegated_nodes(self) -> tuple[NodePlacement, ...]:
        return tuple(p for p in self.nodes if not p.on_cpu)

    def tags(self) -> dict[str, str]:
        """Node name -> tag, for every tagged node and placeholder."""
        tags = {p.node: p.tag for p in self.nodes if p.tag}
        tags.update(self.other_tags)
        return tags

    def summary(self) -> tuple[OpSummary, ...]:
        """Per (op, where, reason): how many nodes. Delegated rows first."""
        counts = collections.Counter(
            (p.op, CPU if p.on_cpu else self.partitions[p.tag].backend_id, p.reason or "")
            for p in self.nodes
        )
        rows = [OpSummary(op, n, where, reason) for (op, where, reason), n in counts.items()]
        return tuple(sorted(rows, key=lambda r: (r.where == CPU, r.where, r.op)))

    def to_json(self) -> dict:
        return {
            "nodes": [attrs.asdict(p) for p in self.nodes],
            "partitions": {
                tag: {
                    "backend_id": spec.backend_id,
                    "compile_specs": [[cs.key, cs.value.hex()] for cs in spec.compile_specs],
                }
                for tag, spec in self.partitions.items()
            },
            "other_tags": dict(self.other_tags),
        }

    @classmethod
    def from_json(cls, data: dict) -> "PlacementPlan":
        partitions = {
            tag: DelegationSpec(
                spec["backend_id"],
                [CompileSpec(key, bytes.fromhex(value)) for key, value in spec["compile_specs"]],
            )
            for tag, spec in data["partitions"].items()
        }
        nodes = tuple(NodePlacement(**p) for p in data["nodes"])
        return cls(nodes, partitions, data["other_tags"])
