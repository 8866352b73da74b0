"""The typed artifacts that flow between stages.

Each type knows its dialect and names the invariants that must hold for it;
the driver checks them after every stage that returns one (verify-each).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Mapping

import attrs
import torch
from torch.utils import _pytree as pytree
from torch.export import ExportedProgram

from compiler.ir import invariants as inv
from compiler.ir.dialect import ATEN, EDGE
from compiler.ir.graph import delegate_calls, graph_text, op_nodes
from compiler.ir.placement import PlacementPlan
from compiler.ir.program_data import ProgramData, program_data, save_program

# The one method of the programs the pipeline makes (its graph's name in `to_edge`'s mapping).
METHOD = "forward"

@attrs.frozen
class ProgramStats:
    nodes: int
    delegates: int | None = None
    cpu_ops: int | None = None


def distinct_inputs(example_inputs: Any) -> tuple:
    """The example inputs with a copy of every tensor whose storage an earlier one already holds.

    torch.export takes two inputs that are one tensor (or views of one storage) to be one
    value for ever: the program reads the second where the first was given, and is silently
    wrong for any other pair of inputs. A program's inputs are each their own tensor.
    """
    seen: set[int] = set()

    def own(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        storage = leaf.untyped_storage().data_ptr()
        if storage in seen:
            return leaf.clone()
        seen.add(storage)
        return leaf

    return tuple(pytree.tree_map(own, tuple(example_inputs)))


@attrs.frozen
class EagerModel:
    """What the user gave: the module, example inputs and dynamic shapes, and the inputs that
    calibrate a static quantization scheme. After the quantize stage, `module` is the eager
    quantized model and `float_module` the model as given."""

    module: torch.nn.Module
    example_inputs: tuple = attrs.field(converter=distinct_inputs)
    dynamic_shapes: Any = None
    calibration: tuple | None = None  # input tuples
    float_module: torch.nn.Module | None = None

    dialect: ClassVar[str] = "eager"
    invariants: ClassVar[tuple] = ()

    def stats(self) -> ProgramStats | None:
        return None

    def graph_text(self) -> str:
        return repr(self.module)


@attrs.frozen
class _ExportedArtifact:
    """An artifact whose program is a torch.export ExportedProgram."""

    program: ExportedProgram

    def stats(self) -> ProgramStats:
        return ProgramStats(nodes=sum(1 for _ in op_nodes(self.program)))

    def graph_text(self) -> str:
        return graph_text(self.program)


# What every Edge artifact holds to, whatever stage made it.
_EDGE_INVARIANTS = (
    inv.program_validates, inv.no_pending_unbacked_symbols, inv.edge_ops_only, inv.constants_listed_once,
    inv.dynamic_sizes_kept,
)


@attrs.frozen
class AtenProgram(_ExportedArtifact):
    """A captured program in the ATen dialect (before decomposition)."""

    dialect: ClassVar[str] = ATEN
    invariants: ClassVar[tuple] = (
        inv.program_validates,
        inv.no_pending_unbacked_symbols,
        inv.aten_ops_only,
        inv.no_transform_regions,
        inv.constants_not_written,
        inv.constants_listed_once,
        inv.constants_own_their_bytes,
        inv.constants_row_major,
        inv.dynamic_sizes_kept,
    )


@attrs.frozen
class KeepWholePlan:
    """Which nodes of an ATen program the decompose stage keeps whole, and why others are not."""

    nodes: frozenset[str] = frozenset()  # names of ATen nodes kept whole
    # ATen node name -> why the dry run decomposes it although the backend asked to keep it.
    dropped: Mapping[str, str] = attrs.field(factory=dict)
    # Set when the dry run did not need to decompose anything to decide.
    skipped: str | None = None

    def to_json(self) -> dict:
        return {"nodes": sorted(self.nodes), "dropped": dict(self.dropped), "skipped": self.skipped}

    @classmethod
    def from_json(cls, data: dict) -> "KeepWholePlan":
        return cls(frozenset(data["nodes"]), data["dropped"], data["skipped"])


@attrs.frozen
class PlannedProgram(AtenProgram):
    """An ATen program with the dry run's answer: which of its nodes to keep whole."""

    keep_whole: KeepWholePlan = attrs.field(factory=KeepWholePlan)
    # The dry run's own decomposition when it is exactly the plan's (it dropped nothing):
    # the decompose stage's output, made already. Never saved: a resumed run makes it again
    # with the same function, so both runs give the same program.
    decomposed: "EdgeProgram | None" = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class EdgeProgram(_ExportedArtifact):
    """A program in the Edge dialect; `preserved_ops` were kept whole for the backend."""

    preserved_ops: tuple[str, ...] = ()
    # The dry run's partition search of this very program, when it handed the program on
    # (the partition stage's output, made already). Never saved, like `decomposed`.
    searched: "PartitionedProgram | None" = attrs.field(default=None, eq=False, repr=False)

    dialect: ClassVar[str] = EDGE
    invariants: ClassVar[tuple] = _EDGE_INVARIANTS + (inv.constants_own_their_bytes, inv.constants_row_major)


@attrs.frozen
class PartitionedProgram(_ExportedArtifact):
    """An Edge program whose nodes carry delegation tags, with the plan that explains them."""

    plan: PlacementPlan
    preserved_ops: tuple[str, ...] = ()
    # Dtypes the backend cannot take as delegate inputs (from the backend).
    refused_input_dtypes: frozenset[str] = frozenset()
    # How the backend split the program, in words (Core ML's pieces).
    split_notes: tuple[str, ...] = ()

    dialect: ClassVar[str] = EDGE
    invariants: ClassVar[tuple] = _EDGE_INVARIANTS + (
        inv.constants_own_their_bytes,
        inv.constants_row_major,
        inv.tag_groups_convex,
        inv.mutable_buffers_not_split,
        inv.delegate_inputs_have_supported_dtypes,
        inv.cpu_ops_have_kernels,
    )

    def stats(self) -> ProgramStats:
        return ProgramStats(
            nodes=len(self.plan.nodes),
            delegates=len({p.tag for p in self.plan.delegated_nodes}),
            cpu_ops=len(self.plan.cpu_nodes),
        )

    def graph_text(self) -> str:
        placement = "".join(
            f"#   {p.node}: {self.plan.where(p)}{f'  ({p.reason})' if p.reason else ''}\n" for p in self.plan.nodes
        )
        return graph_text(self.program) + "\n# placement\n" + placement


@attrs.frozen
class SplitProgram(PartitionedProgram):
    """A partitioned program in which every constant a delegate owns is read only by that delegate."""

    invariants: ClassVar[tuple] = PartitionedProgram.invariants + (inv.constant_tags_match_users,)


@attrs.frozen
class LoweredProgram(_ExportedArtifact):
    """An Edge program whose delegated parts are backend payloads behind delegate calls."""

    plan: PlacementPlan
    preserved_ops: tuple[str, ...] = ()

    dialect: ClassVar[str] = EDGE
    invariants: ClassVar[tuple] = _EDGE_INVARIANTS + (
        inv.cpu_ops_have_kernels, inv.delegate_payloads_pass_their_backend_checks, inv.delegates_within_rank_limits,
    )

    def stats(self) -> ProgramStats:
        cpu = sum(1 for _ in op_nodes(self.program))
        delegates = len(delegate_calls(self.program))
        return ProgramStats(nodes=cpu + delegates, delegates=delegates, cpu_ops=cpu)


@attrs.frozen
class LoweredMethods:
    """The lowered programs of a program of several methods, by method name: emit makes one `.pte`
    of them, so weights and state they share are stored and planned once."""

    methods: Mapping[str, LoweredProgram]

    dialect: ClassVar[str] = EDGE
    invariants: ClassVar[tuple] = ()  # each method's program was verified as it was lowered

    def stats(self) -> ProgramStats:
        each = [lowered.stats() for lowered in self.methods.values()]
        return ProgramStats(
            nodes=sum(s.nodes for s in each), delegates=sum(s.delegates or 0 for s in each),
            cpu_ops=sum(s.cpu_ops or 0 for s in each),
        )

    def graph_text(self) -> str:
        return "\n".join(f"// method {name}\n{lowered.graph_text()}" for name, lowered in self.methods.items())


@attrs.frozen
class ExecutorchProgram:
    """The emitted `.pte`: its bytes, the operators it calls and its delegate payloads. `plan` is
    the placement of its one method (a program of several has each method's in its method's
    result; here an empty plan)."""

    data: ProgramData = attrs.field(converter=program_data)  # the `.pte`: bytes, or a file for a large one
    operators: tuple[str, ...]  # each distinct CPU kernel, e.g. "aten::add.out"
    delegates: tuple[str, ...]  # the backend id of each delegate payload
    plan: PlacementPlan
    kernel_calls: int = 0
    delegate_calls: int = 0
    # The data file (`.ptd`) holding the program's weights, when they were kept out of the `.pte`.
    weights: ProgramData | None = attrs.field(default=None, converter=attrs.converters.optional(program_data))

    dialect: ClassVar[str] = "executorch"
    invariants: ClassVar[tuple] = (inv.pte_operators_registered,)

    @property
    def pte(self) -> bytes:
        """The `.pte`'s bytes (read from its file for a large program: `data` saves or maps it
        without reading it)."""
        return self.data.read()

    def save(self, path: str | os.PathLike) -> tuple[str, ...]:
        """Write the `.pte` to `path` and its data file, if it has one, beside it as `.ptd`; the
        paths written."""
        return save_program(path, self.data, self.weights)

    def stats(self) -> ProgramStats:
        return ProgramStats(
            nodes=self.kernel_calls + self.delegate_calls,
            delegates=self.delegate_calls,
            cpu_ops=self.kernel_calls,
        )

    def graph_text(self) -> str:
        lines = [f"# {len(self.data)} bytes"]
        lines += [f"operator {name}" for name in self.operators]
        lines += [f"delegate {backend}" for backend in self.delegates]
        return "\n".join(lines) + "\n"


STAGE_ARTIFACT_TYPES = (
    EagerModel,
    AtenProgram,
    PlannedProgram,
    EdgeProgram,
    PartitionedProgram,
    SplitProgram,
    LoweredProgram,
    ExecutorchProgram,
)


@attrs.frozen
class StageArtifacts(Mapping[str, Any]):
    """Each stage's artifact a run produced, by attribute (typed) or by stage name (a stage that
    did not run, or whose output the stage cache stood in for without loading it, is None and
    absent from the mapping). The fields are the stage table's names (a test holds them to it)."""

    quantize: EagerModel | None = None
    capture: AtenProgram | None = None
    precision: AtenProgram | None = None
    fold: AtenProgram | None = None
    dry_run: PlannedProgram | None = None
    decompose: EdgeProgram | None = None
    partition: PartitionedProgram | None = None
    split_constants: SplitProgram | None = None
    lower: LoweredProgram | None = None
    emit: ExecutorchProgram | None = None

    @classmethod
    def of(cls, artifacts: Mapping[str, Any]) -> "StageArtifacts":
        """From a mapping by stage name; a name that is no stage's is an error."""
        if isinstance(artifacts, cls):
            return artifacts
        return cls(**dict(artifacts))

    def __getitem__(self, name: str) -> Any:
        value = getattr(self, name, None) if name in _STAGE_FIELDS else None
        if value is None:
            raise KeyError(name)
        return value

    def __iter__(self):
        return (name for name in _STAGE_FIELDS if getattr(self, name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


_STAGE_FIELDS = tuple(field.name for field in attrs.fields(StageArtifacts))
