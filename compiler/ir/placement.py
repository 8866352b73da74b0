"""Where every node of a partitioned program runs, and why.

The plan is the partition stage's answer, kept beside the tagged program: for
each node its delegation tag and backend, or, for a node left on the CPU, the
reason the backend gave. It is what the placement report prints and what the
lower stage replays.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Mapping

import attrs

from compiler.ir.targets import BY_DELEGATE_ID

if TYPE_CHECKING:
    import torch
    from torch.export import ExportedProgram

    from executorch.exir.backend.partitioner import DelegationSpec

CPU = "cpu"
# The node meta key under which a backend says what it makes of a node it took (a quantized
# GEMM, a quantize it folds in); without it a delegated node's reason is that the partitioner took it.
DELEGATED_REASON = "delegated_reason"

# Op namespaces whose CPU kernels are ExecuTorch's portable kernels.
_PORTABLE_NAMESPACES = ("aten", "dim_order_ops")

_FLOATING = ("float16", "bfloat16", "float32", "float64")
# The compile spec that sets the floating precision a delegate computes in (Core ML's), and its
# value where a backend's specs leave it out (ExecuTorch's `model_compute_precision_from_compile_specs`).
COMPUTE_PRECISION_SPEC = "compute_precision"


def backend_name(backend_id: str) -> str:
    """The name a user knows a delegate by (`CoreMLBackend` -> `Core ML`)."""
    target = BY_DELEGATE_ID.get(backend_id)
    return target.display_name if target else backend_id


def cpu_kernel(op: str) -> str:
    """Where a CPU op's kernel comes from, in words: the portable library or the op's own."""
    namespace = op.split(".", 1)[0]
    return "CPU (portable kernel)" if namespace in _PORTABLE_NAMESPACES else f"CPU ({namespace} kernel)"


def _dtypes(node: torch.fx.Node) -> list[str]:
    import torch
    from torch.utils import _pytree as pytree

    leaves = pytree.tree_leaves(node.meta.get("val"))
    return [str(leaf.dtype).removeprefix("torch.") for leaf in leaves if isinstance(leaf, torch.Tensor)]


def computed_dtype(node: torch.fx.Node) -> str | None:
    """The dtype a node computes in as the program says: its result's when floating, else its
    first floating input's (a comparison), else its result's (None for no tensor)."""
    results = _dtypes(node)
    inputs = [dtype for arg in node.all_input_nodes for dtype in _dtypes(arg)]
    floating = [dtype for dtype in results + inputs if dtype in _FLOATING]
    return floating[0] if floating else next(iter(results), None)


@attrs.frozen
class NodePlacement:
    node: str
    op: str
    tag: str | None
    reason: str | None = None  # set for nodes left on the CPU, and delegated ones a backend says more of
    dtype: str | None = None  # what the node computes in as the program says (`computed_dtype`)

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
class PlacedNode:
    """One node's placement for a reader: ExecuTorch's terms (op, backend id, tag) and words
    (where it runs, why)."""

    node: str
    op: str
    where: str  # "Core ML delegate 1", "CPU (portable kernel)"
    backend_id: str | None  # None on the CPU
    tag: str | None
    reason: str
    precision: str | None = None  # what it computes in: its dtype, or its delegate's compute precision


@attrs.frozen
class BackendShare:
    """How many of the program's ops one delegate backend (or the CPU) runs."""

    backend_id: str | None  # None for the CPU
    name: str  # "Core ML", "CPU"
    ops: int
    total: int

    @property
    def percent(self) -> int:
        """Rounded, but never to 0 or 100 unless none or all: 599 of 600 is not 100%."""
        share = round(100 * self.ops / self.total) if self.total else 0
        return min(max(share, 1 if self.ops else 0), 99 if self.ops < self.total else 100)

    def __str__(self) -> str:
        return f"{self.name}: {self.ops} of {self.total} ops ({self.percent}%)"


@attrs.frozen
class ReportedSpec:
    """A compile spec as a report reads it (ExecuTorch's `CompileSpec` has the same fields)."""

    key: str
    value: bytes


@attrs.frozen
class ReportedPartition:
    """A partition's backend and compile specs as a report reads them (ExecuTorch's
    `DelegationSpec` has the same fields), for a plan loaded without importing ExecuTorch."""

    backend_id: str
    compile_specs: Any = attrs.field(converter=tuple)  # of ReportedSpec


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
        from compiler.ir.dialect import op_name
        from compiler.ir.graph import DELEGATION_TAG, op_nodes

        placements = []
        for node in op_nodes(ep):
            tag = node.meta.get(DELEGATION_TAG)
            reason = node.meta.get(DELEGATED_REASON) if tag else cpu_reasons[node.name]
            placements.append(NodePlacement(node.name, op_name(node.target), tag, reason, computed_dtype(node)))
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

    def precision(self, placement: NodePlacement) -> str | None:
        """What a node computes in: on the CPU its dtype; in a delegate with a compute precision
        (Core ML: float16 unless its compile specs say otherwise), that one for floating values."""
        if placement.on_cpu or placement.dtype not in _FLOATING:
            return placement.dtype
        spec = self.partitions[placement.tag]
        given = next((s.value.decode() for s in spec.compile_specs if s.key == COMPUTE_PRECISION_SPEC), None)
        target = BY_DELEGATE_ID.get(spec.backend_id)
        return given or (target and target.default_compute_precision) or placement.dtype

    def delegate_numbers(self) -> dict[str, int]:
        """Tag -> the delegate's number for its backend (1, 2, ...), in program order."""
        numbers: dict[str, int] = {}
        seen: collections.Counter[str] = collections.Counter()
        for placement in self.nodes:
            if placement.tag and placement.tag not in numbers:
                backend_id = self.partitions[placement.tag].backend_id
                seen[backend_id] += 1
                numbers[placement.tag] = seen[backend_id]
        return numbers

    def described(self) -> tuple[PlacedNode, ...]:
        """Every op node with where it runs and why, in ExecuTorch's terms and in words."""
        numbers = self.delegate_numbers()
        rows = []
        for p in self.nodes:
            if p.on_cpu:
                rows.append(PlacedNode(p.node, p.op, cpu_kernel(p.op), None, None, p.reason or "", p.dtype))
                continue
            backend_id = self.partitions[p.tag].backend_id
            name = backend_name(backend_id)
            rows.append(
                PlacedNode(
                    p.node, p.op, f"{name} delegate {numbers[p.tag]}", backend_id, p.tag,
                    p.reason or f"the {name} partitioner took it", self.precision(p),
                )
            )
        return tuple(rows)

    def shares(self) -> tuple[BackendShare, ...]:
        """The ops each delegate backend runs, then the CPU's, out of every op node."""
        total = len(self.nodes)
        counts = collections.Counter(self.partitions[p.tag].backend_id for p in self.delegated_nodes)
        delegated = [BackendShare(b, backend_name(b), n, total) for b, n in sorted(counts.items())]
        return (*delegated, BackendShare(None, "CPU", len(self.cpu_nodes), total))

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
    def from_json(cls, data: dict, *, for_report: bool = False) -> "PlacementPlan":
        """The plan `to_json` wrote. `for_report`: its partitions as `ReportedPartition`s, which
        need no ExecuTorch import but cannot be lowered (a program cache hit's report)."""
        if for_report:
            make_spec, make_partition = ReportedSpec, ReportedPartition
        else:
            from executorch.exir.backend.compile_spec_schema import CompileSpec as make_spec
            from executorch.exir.backend.partitioner import DelegationSpec as make_partition
        partitions = {
            tag: make_partition(
                spec["backend_id"],
                [make_spec(key, bytes.fromhex(value)) for key, value in spec["compile_specs"]],
            )
            for tag, spec in data["partitions"].items()
        }
        nodes = tuple(NodePlacement(**p) for p in data["nodes"])
        return cls(nodes, partitions, data["other_tags"])
