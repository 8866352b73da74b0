"""The partition search: Edge program -> the same program with delegation tags, and a placement plan.

The backend's partition search tags a copy of the graph (the Edge artifact
stays as it was); every node it leaves untagged gets the backend's reason.

A mutated buffer's new value that is also returned reaches the caller through a
copy capture made (`to_backend` refuses a delegate output that is both). Where no
delegate owns the buffer, that copy runs on the CPU: XNNPACK drops a copy it takes
and then refuses the pass-through. A delegate that owns the buffer keeps the copy,
since the buffer's value never leaves it.

After the search, a tag group that a path leaves and re-enters is split into groups
`to_backend` can fuse (`compiler/ir/convexity.py`), and CPU calls that a portable kernel
refuses (a 3-D convolution) are rewritten into calls it takes
(`compiler/passes/cpu_rewrites.py`); the placement plan says both where they happened.
"""

from __future__ import annotations

import attrs
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind

from compiler.backends.base import Backend
from compiler.ir.artifacts import EdgeProgram, PartitionedProgram
from compiler.ir.convexity import Reentry, split_reentered_groups
from compiler.ir.dialect import EDGE
from compiler.ir.errors import CompileError
from compiler.ir.graph import DELEGATION_TAG, copy_program, op_nodes
from compiler.ir.placement import PlacementPlan
from compiler.passes.cpu_rewrites import rewrite_for_cpu_kernels
from compiler.passes.folding import default_skip_ops, fold_constants, needs_folding


RETURNED_BUFFER_COPY = (
    "the model returns a buffer's new value, and no delegate owns that buffer: the CPU makes "
    "the returned copy (a delegate output cannot be both)"
)


def returned_buffer_copies(program: ExportedProgram) -> list:
    """Copy nodes whose input is the new value of a buffer no delegate owns, and whose
    result is a user output."""
    signature = program.graph_signature
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    owned = {s.target for s in signature.input_specs if placeholders[s.arg.name].meta.get(DELEGATION_TAG)}
    new_values = {
        s.arg.name for s in signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION and s.target not in owned
    }
    returned = {s.arg.name for s in signature.output_specs if s.kind == OutputKind.USER_OUTPUT}
    return [
        n for n in op_nodes(program)
        if n.name in returned and "clone" in str(n.target) and getattr(n.args[0], "name", None) in new_values
    ]


def split_reasons(paths: list[Reentry], reasons: dict[str, str]) -> dict[str, str]:
    """The CPU reasons of the nodes on each path that left a group and came back, saying so."""
    told = dict(reasons)
    for path in paths:
        for name in path.outside:
            if name in told:
                told[name] += (
                    f"; a path from {path.exit} through it comes back into the same delegate at {path.entry}, "
                    f"so that delegate ({path.tag}) was split there (one delegate call cannot both feed and read it)"
                )
    return told


def partition(edge: EdgeProgram, backend: Backend, state: frozenset[str] = frozenset()) -> PartitionedProgram:
    """The backend's partition search on a copy of `edge` (the dry run uses this too); the
    buffers of `state` (written by another method) are not folded."""
    program = copy_program(edge.program)
    skip = default_skip_ops(EDGE)
    if backend.folds_decomposed_constants and needs_folding(program, skip, tiny_fills=True, state=state):
        fold_constants(program, EDGE, skip, tiny_fills=True, state=state)
    result = backend.partition(program)
    pinned = returned_buffer_copies(program)
    for node in pinned:
        node.meta.pop(DELEGATION_TAG, None)
    unknown = sorted(
        {n.meta[DELEGATION_TAG] for n in program.graph.nodes if n.meta.get(DELEGATION_TAG)}
        - set(result.partitions)
    )
    if unknown:
        raise CompileError(
            f"the {backend.name} backend tagged nodes with tags it gave no backend for: {unknown}",
            hint="the backend's partition() must return a DelegationSpec for every tag it uses",
        )
    partitions, reentered = split_reentered_groups(program.graph, result.partitions)

    def backend_reason(node) -> str:
        return result.cpu_reasons.get(node.name) or backend.default_cpu_reason(node)

    reasons = {n.name: RETURNED_BUFFER_COPY for n in pinned}
    reasons |= rewrite_for_cpu_kernels(program, backend_reason)  # CPU calls a portable kernel refuses, rewritten
    reasons |= {
        n.name: reasons.get(n.name) or backend_reason(n) for n in op_nodes(program) if not n.meta.get(DELEGATION_TAG)
    }
    plan = PlacementPlan.from_tagged_program(program, partitions, split_reasons(reentered, reasons))
    refused = frozenset(str(d).removeprefix("torch.") for d in backend.refused_input_dtypes)
    return PartitionedProgram(program, plan, edge.preserved_ops, refused, result.notes)


def keep_program_state(partitioned: PartitionedProgram, names: frozenset[str]) -> tuple[PartitionedProgram, list[str]]:
    """The buffers of `names` a delegate took stay the program's, given to the delegate as inputs:
    a delegate copies a buffer it only reads into its payload as a constant, so it would never see
    what another method of the program writes there. Returns the program and those buffers."""
    buffers = partitioned.program.graph_signature.inputs_to_buffers
    taken = {
        n.name: buffers[n.name] for n in partitioned.program.graph.nodes
        if n.op == "placeholder" and buffers.get(n.name) in names and n.meta.get(DELEGATION_TAG)
    }
    if not taken:
        return partitioned, []
    program = copy_program(partitioned.program)
    for node in program.graph.nodes:
        if node.name in taken:
            node.meta.pop(DELEGATION_TAG)
    other_tags = {name: tag for name, tag in partitioned.plan.other_tags.items() if name not in taken}
    plan = attrs.evolve(partitioned.plan, other_tags=other_tags)
    return attrs.evolve(partitioned, program=program, plan=plan), sorted(taken.values())
