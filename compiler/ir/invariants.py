"""Invariants of the artifact types, each a small named check with a hint.

A check returns None when the program is fine, or a `Violation` naming the
nodes and the reason. `Invariant.verify` turns a violation into the
`VerificationError` the driver reports with the stage name.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Hashable, Iterator, Mapping

import attrs
import torch
from torch.utils import _pytree as pytree
from torch.export.graph_signature import InputKind

from compiler.ir import dynamic
from compiler.ir.convexity import reentries
from compiler.ir.dialect import ATEN, EDGE, op_dialect, op_name
from compiler.ir.errors import VerificationError
from compiler.ir.private_api import delegate_named_data
from compiler.ir.graph import (
    CONSTANT_INPUT_KINDS,
    DELEGATION_TAG,
    TRANSFORM_MARKERS,
    call_nodes,
    constant_placeholders,
    mutated_buffer_targets,
    writes_argument,
)
from compiler.ir.kernel_limits import kernel_limit
from compiler.ir.kernels import missing_kernel, registered_kernels, wrong_kernel


@attrs.frozen
class Violation:
    reason: str
    nodes: tuple[str, ...] = ()


@attrs.frozen
class Invariant:
    name: str
    hint: str
    check: Callable[[Any], Violation | None]
    # What the check's verdict depends on, if cheaper to compute than the check: an artifact
    # with the key of one that passed passes (the verify instrument asks it once per run).
    key: Callable[[Any], Hashable] | None = None

    def verify(self, artifact: Any, stage: str | None = None) -> None:
        violation = self.check(artifact)
        if violation is not None:
            raise VerificationError(
                self.name, violation.reason, stage=stage, nodes=violation.nodes, hint=self.hint
            )


def _violation_if_any(offenders, reason: str) -> Violation | None:
    """How most checks end: a violation naming the offending nodes, or None when there are none."""
    return Violation(reason, tuple(offenders)) if offenders else None


def invariant(
    hint: str, key: Callable[[Any], Hashable] | None = None
) -> Callable[[Callable[[Any], Violation | None]], Invariant]:
    def wrap(check: Callable[[Any], Violation | None]) -> Invariant:
        return Invariant(check.__name__, hint, check, key)

    return wrap


def _value_form(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), str(tuple(value.shape)), str(value.stride()), str(value.device))
    if isinstance(value, (list, tuple)):
        return tuple(_value_form(v) for v in value)
    return str(value) if value is not None else None


def validated_form(artifact) -> Hashable:
    """All the ExportedProgram verifiers read: the verifier classes, the signature, the constants'
    names, and per node its op, target, arguments and value's dtype, shape, strides and device.
    The partition stage tags a copy of the Edge program decompose made and validated: the
    same form, so its own validation (a second second-long pass over a depth-48 stack's nodes)
    is not repeated."""
    program = artifact.program
    nodes = tuple(
        (
            n.name,
            n.op,
            str(n.target),
            repr(torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.name)),
            _value_form(n.meta.get("val")),
        )
        for n in program.graph.nodes
    )
    return (
        tuple(type(v).__qualname__ for v in program.verifiers),
        str(program.graph_signature),
        str(program.range_constraints),
        tuple(sorted(program.constants)),
        tuple(sorted(program.state_dict)),
        nodes,
    )


@invariant("this is a bug in the stage that produced the program; report it with the dumped input", key=validated_form)
def program_validates(artifact) -> Violation | None:
    try:
        with dynamic.fresh_symbols_dropped(artifact.program):
            artifact.program.validate()  # torch's public spelling of _validate()
    except Exception as exc:  # the verifier raises several exception types
        return Violation(f"the ExportedProgram verifier failed: {type(exc).__name__}: {exc}")
    return None


@invariant("a pass re-ran data-dependent ops on the program's fake values without binding their sizes; "
           "run it under `fresh_symbols_dropped`, or give the node that makes the size its `unbacked_bindings`")
def no_pending_unbacked_symbols(artifact) -> Violation | None:
    pending = {str(s) for s in dynamic.pending_unbacked_symbols(artifact.program)}
    if not pending:
        return None
    holders = [n.name for n in artifact.program.graph.nodes if set(dynamic.symbols_held(n)) & pending]
    where = f"held by {', '.join(holders)}" if holders else "no node binds or holds it"
    return Violation(f"data-dependent size(s) {', '.join(sorted(pending))} left pending: {where}", tuple(holders))


def _foreign_ops(artifact, dialect: str) -> Violation | None:
    bad = [
        n.name
        for n in call_nodes(artifact.program)
        if op_dialect(n.target) not in (None, dialect)
    ]
    return _violation_if_any(bad, f"a {dialect.upper()} program holds ops of another dialect")


@invariant("a pass inserted an op of the wrong dialect; use the op overload of the program's dialect")
def aten_ops_only(artifact) -> Violation | None:
    return _foreign_ops(artifact, ATEN)


@invariant("a pass inserted an op of the wrong dialect; use the Edge op (exir_ops.edge...)")
def edge_ops_only(artifact) -> Violation | None:
    return _foreign_ops(artifact, EDGE)


@invariant("capture inlines vmap regions; a stage after it must not bring functorch's markers back")
def no_transform_regions(artifact) -> Violation | None:
    marked = [n.name for n in call_nodes(artifact.program) if n.target in TRANSFORM_MARKERS]
    return _violation_if_any(marked, "the program holds a functorch transform region (vmap) whose values are batched")


@invariant("capture makes every constant the program writes a buffer; a stage after it wrote a constant")
def constants_not_written(artifact) -> Violation | None:
    ep = artifact.program
    constants = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.CONSTANT_TENSOR}
    written = [
        n.name
        for n in ep.graph.nodes
        if n.op == "placeholder" and n.name in constants and any(writes_argument(u, n) for u in n.users)
    ]
    return _violation_if_any(
        written, "lifted constants are written in place (a constant's write would outlive the call)"
    )


@invariant(
    "something took a dynamic size as a number (int(size), a comparison) and fixed it for every program "
    "sharing its shape environment; the program would run at the example's size only. Report it with the "
    "dumped input; meanwhile compile with static shapes"
)
def dynamic_sizes_kept(artifact) -> Violation | None:
    fixed = dynamic.fixed_sizes(artifact.program)
    if not fixed:
        return None
    return Violation(f"a size declared dynamic was fixed: {'; '.join(fixed)}")


@invariant("give each copy of a constant its own target (the split-constants stage does this)")
def constants_listed_once(artifact) -> Violation | None:
    ep = artifact.program
    targets = collections.Counter(
        spec.target for spec in ep.graph_signature.input_specs if spec.kind in CONSTANT_INPUT_KINDS
    )
    repeated = sorted(t for t, n in targets.items() if n > 1)
    if repeated:
        return Violation(
            "constant/buffer targets listed more than once in the graph signature "
            "(such a program cannot be unlifted)",
            tuple(repeated),
        )
    missing = [
        spec.target
        for spec in ep.graph_signature.input_specs
        if spec.kind in CONSTANT_INPUT_KINDS
        and spec.target not in ep.state_dict
        and spec.target not in ep.constants
    ]
    return _violation_if_any(missing, "graph signature names constants that hold no data")


def owns_its_bytes(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is all of its storage: not a view into a larger one.

    Delegates serialize a constant's storage from its start (XNNPACK's
    `get_serialized_buffer_index` reads `untyped_storage()`), so a slice `p[2:10]`
    would be read as `p[0:8]`. The layout may still be any dense one (a transposed
    parameter is fine: its placeholder carries the strides, the Edge program its dim order).
    """
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def row_major(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has the strides of a contiguous tensor of its shape (size-1 dims too)."""
    return tensor.stride() == torch._prims_common.make_contiguous_strides_for(tensor.shape)


def plain_tensor(value: Any) -> bool:
    """Tensors whose bytes are their storage (not quantized wrappers or script objects)."""
    return type(value) in (torch.Tensor, torch.nn.Parameter)


def _plain_constants(ep) -> Iterator[tuple[str, torch.Tensor]]:
    """The target and value of each constant in the signature whose value is a plain tensor:
    the ones a delegate or the runtime reads as raw bytes."""
    for spec in ep.graph_signature.input_specs:
        if spec.kind in CONSTANT_INPUT_KINDS:
            value = ep.state_dict.get(spec.target, ep.constants.get(spec.target))
            if plain_tensor(value):
                yield spec.target, value


@invariant(
    "a stage stored a view as a constant: store `value.clone(memory_format=torch.contiguous_format)` "
    "(capture does this for the model's own views, fold for the constants it makes)"
)
def constants_own_their_bytes(artifact) -> Violation | None:
    views = [
        f"{target} ({value.numel() * value.element_size()} bytes at element offset "
        f"{value.storage_offset()} of a {value.untyped_storage().nbytes()}-byte storage)"
        for target, value in _plain_constants(artifact.program)
        if not owns_its_bytes(value)
    ]
    return _violation_if_any(
        views, "constants are views into a larger storage; a delegate would serialize the wrong bytes"
    )


@invariant(
    "a stage stored a constant in another layout: store `value.clone(memory_format=torch.contiguous_format)` "
    "(capture does this for the model's constants, fold for the constants it makes)"
)
def constants_row_major(artifact) -> Violation | None:
    strided = [
        f"{target} (shape {tuple(value.shape)}, strides {value.stride()})"
        for target, value in _plain_constants(artifact.program)
        if not row_major(value)
    ]
    return _violation_if_any(
        strided, "constants are not stored row-major; ExecuTorch reads a dim order from the strides and refuses most"
    )


@invariant("constants must be tagged like all their users; split shared constants per tag group")
def constant_tags_match_users(artifact) -> Violation | None:
    ep = artifact.program
    constants = constant_placeholders(ep)
    bad = []
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in constants:
            continue
        tag = node.meta.get(DELEGATION_TAG)
        if tag is None:
            continue
        for user in node.users:
            if user.meta.get(DELEGATION_TAG) != tag:
                bad.append(
                    f"{node.name} (tag {tag}) -> {user.name} (tag {user.meta.get(DELEGATION_TAG)})"
                )
    return _violation_if_any(bad, "a constant is tagged for a delegate but read by a node with another tag")


@invariant(
    "a mutable buffer a delegate takes over must be used only inside it; move the ops "
    "that use it together, or keep the state on the CPU (the backend's option for taking over mutable buffers)"
)
def mutable_buffers_not_split(artifact) -> Violation | None:
    """A delegate that owns a buffer's state cannot share it: the other side would read stale values.
    (A buffer the CPU owns may be read by a delegate as an ordinary input.)"""
    ep = artifact.program
    mutated = mutated_buffer_targets(ep)
    if not mutated:
        return None
    writers = {spec.target: spec.arg.name for spec in ep.graph_signature.output_specs if spec.target in mutated}
    nodes = {n.name: n for n in ep.graph.nodes}
    bad = []
    for spec in ep.graph_signature.input_specs:
        placeholder = nodes.get(spec.arg.name)
        if spec.target not in mutated or placeholder is None or not placeholder.meta.get(DELEGATION_TAG):
            continue
        touching = [n for n in placeholder.users if n.op == "call_function"]
        writer = nodes.get(writers.get(spec.target, ""))
        if writer is not None and writer.op == "call_function" and writer not in touching:
            touching.append(writer)
        owner = placeholder.meta[DELEGATION_TAG]
        if any(n.meta.get(DELEGATION_TAG) != owner for n in touching):
            bad += [f"{n.name} on {n.meta.get(DELEGATION_TAG) or 'cpu'}" for n in touching]
    return _violation_if_any(bad, "a mutable buffer owned by a delegate is also used outside it")


@invariant(
    "a delegate is one call, so no path may leave its tag group and come back into it: split the group "
    "where the path leaves it (the partition stage does this after the backend's search), or tag the "
    "outside nodes with it"
)
def tag_groups_convex(artifact) -> Violation | None:
    paths = reentries(artifact.program.graph)
    nodes = [name for p in paths for name in (p.exit, *p.outside, p.entry)]
    return _violation_if_any(nodes, "; ".join(map(str, paths)))


@invariant("leave the op reading that tensor on the CPU up to a conversion the backend takes")
def delegate_inputs_have_supported_dtypes(artifact) -> Violation | None:
    refused = artifact.refused_input_dtypes
    if not refused:
        return None
    bad = []
    for node in artifact.program.graph.nodes:
        tag = node.meta.get(DELEGATION_TAG)
        if not tag or node.op == "placeholder":
            continue
        for source in node.all_input_nodes:
            value = source.meta.get("val")
            dtype = str(getattr(value, "dtype", "")).removeprefix("torch.")
            if source.meta.get(DELEGATION_TAG) != tag and dtype in refused:
                bad.append(f"{node.name} ({tag}) reads {source.name} ({dtype})")
    return _violation_if_any(bad, "a delegate takes an input of a dtype its backend cannot take")


@invariant(
    "the op stays on the CPU but the runtime has no kernel for it (or one that refuses these inputs, "
    "see compiler/ir/kernel_limits.py): let the backend take it, or let it decompose (do not keep it "
    "whole), or change the model so the op gets inputs the kernel takes"
)
def cpu_ops_have_kernels(artifact) -> Violation | None:
    ep = artifact.program
    bad = []
    for node in call_nodes(ep):
        if node.meta.get(DELEGATION_TAG):
            continue
        kernel = missing_kernel(node.target)
        if kernel:
            bad.append(f"{node.name} ({op_name(node.target)} needs {kernel})")
        wrong = wrong_kernel(node)
        if wrong:
            bad.append(f"{node.name} ({op_name(node.target)}: the runtime's kernel is wrong here: {wrong})")
        limit = kernel_limit(node)
        if limit:
            refuses = f"the runtime's kernel refuses {limit.limit}: {limit.source}: {limit.reason}"
            bad.append(f"{node.name} ({op_name(node.target)}: {refuses})")
    return _violation_if_any(
        bad, "ops left on the CPU have no kernel, or a wrong one or one refusing their inputs, in the ExecuTorch runtime"
    )


@invariant("the program would fail to load; see the operators named and keep them off the CPU")
def pte_operators_registered(artifact) -> Violation | None:
    kernels = registered_kernels()
    bad = [name for name in artifact.operators if name not in kernels]
    return _violation_if_any(bad, "the .pte calls operators the ExecuTorch runtime does not register")


# Delegate id -> (a check of one of its payloads: the faults found, none when it is sound; what
# such a fault means). A backend registers its own when its package loads, so this layer
# knows no backend (the Core ML backend: no MIL op adds an epsilon the program does not).
PayloadCheck = Callable[[bytes, Mapping[str, bytes]], list[str]]  # (processed bytes, the delegate's named data)
_PAYLOAD_CHECKS: dict[str, tuple[PayloadCheck, str]] = {}


def register_payload_check(backend_id: str, means: str) -> Callable[[PayloadCheck], PayloadCheck]:
    def register(check: PayloadCheck) -> PayloadCheck:
        _PAYLOAD_CHECKS[backend_id] = (check, means)
        return check

    return register


@invariant(
    "a backend's conversion of a torch op made a payload that computes other numbers than the "
    "program (e.g. 1 / x computed as 1 / (x + 1e-4)); keep the torch op on the CPU and report it"
)
def delegate_payloads_pass_their_backend_checks(artifact) -> Violation | None:
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    bad, meanings = [], []
    for name, module in artifact.program.graph_module.named_children():
        if isinstance(module, LoweredBackendModule) and module.backend_id in _PAYLOAD_CHECKS:
            check, means = _PAYLOAD_CHECKS[module.backend_id]
            found = check(module.processed_bytes, delegate_named_data(module))
            bad += [f"{name}: {fault}" for fault in found]
            if found and means not in meanings:
                meanings.append(means)
    return _violation_if_any(bad, "; ".join(meanings))


_RANK_LIMITS: dict[str, int] = {}


def register_rank_limit(backend_id: str, limit: int) -> None:
    """The most dimensions a tensor inside the backend's payloads may have (its runtime refuses more)."""
    _RANK_LIMITS[backend_id] = limit


@invariant("a refusal rule let an op over the backend's tensor rank through; keep such ops on the CPU")
def delegates_within_rank_limits(artifact) -> Violation | None:
    """A payload holding a tensor of more dimensions than its runtime defines fails only at load
    on the device ("Failed to define tensor ... xnn_status_unsupported_parameter")."""
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    over = []
    for name, module in artifact.program.graph_module.named_children():
        limit = _RANK_LIMITS.get(getattr(module, "backend_id", None)) if isinstance(module, LoweredBackendModule) else None
        if limit is None:
            continue
        for node in module.original_module.graph.nodes:
            ranks = [v.dim() for v in pytree.tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
            if ranks and max(ranks) > limit:
                over.append(f"{name}: {node.name} ({max(ranks)}-D, {module.backend_id} takes {limit})")
    return _violation_if_any(over, "a delegate holds a tensor of more dimensions than its runtime takes")


# --- a stage leaves its input as it was -------------------------------------------------------
# Every stage's artifact is kept (the result's `stages`, stage files, re-lowering at another
# precision, locating a divergence by stage): a stage that changed the program it was given in
# place would leave an earlier artifact that no longer is what its stage made.

STAGE_INPUT_KEPT = "stage_input_kept"
STAGE_INPUT_KEPT_HINT = (
    "this is a bug in the stage: it changed the program it was given, which the run keeps as the "
    "earlier stage's artifact; report it with the dumped stage input"
)


def program_fingerprint(artifact) -> dict[str, tuple] | None:
    """What a stage must not change in the program it is given: its nodes (with their delegation
    tags), its signature and the names of the constants and state it holds (None: no program)."""
    program = getattr(artifact, "program", None)
    if not isinstance(program, torch.export.ExportedProgram):
        return None
    signature = program.graph_signature
    return {
        "nodes": tuple((n.name, n.op, str(n.target), n.meta.get(DELEGATION_TAG)) for n in program.graph.nodes),
        "inputs": tuple((s.kind.name, getattr(s.arg, "name", None), s.target) for s in signature.input_specs),
        "outputs": tuple((s.kind.name, getattr(s.arg, "name", None), s.target) for s in signature.output_specs),
        "constants": tuple(sorted(program.constants)),
        "state": tuple(sorted(program.state_dict)),
    }


def _names(entries: tuple) -> list[str]:
    return [str(e[0] if isinstance(e, tuple) else e) for e in entries]


def stage_input_kept(before: dict[str, tuple] | None, artifact) -> Violation | None:
    """A violation naming what the stage changed in its input since `before` (its fingerprint)."""
    after = program_fingerprint(artifact)
    if before is None or after is None or after == before:
        return None
    changed = []
    for part, was in before.items():
        now = after[part]
        if now == was:
            continue
        gone = _names(tuple(x for x in was if x not in now))[:5]
        new = _names(tuple(x for x in now if x not in was))[:5]
        what = "; ".join(
            [f"removed {', '.join(gone)}"] * bool(gone) + [f"added {', '.join(new)}"] * bool(new)
        ) or "changed in place"
        changed.append(f"its {part}: {what}")
    return Violation("the stage changed the program it was given (" + "; ".join(changed) + ")")


# --- state another method writes stays read at run time ---------------------------------------
# In a program of several methods a buffer one method only reads may be written by another: its
# value at capture is not what the method reads. A stage that folded it, or a delegate that took
# it into its payload, makes a constant of it, and the method silently computes with the captured
# value. Compared between a stage's input and output: the buffers of the state read at run time
# must stay read at run time.

PROGRAM_STATE_READ = "program_state_read"
PROGRAM_STATE_READ_HINT = (
    "this is a bug in the stage: state another method writes must reach this method as the program's "
    "buffer (compile_methods passes it as partition_program_state); report it with the dumped stage input"
)


def state_read(artifact, state: frozenset[str]) -> frozenset[str] | None:
    """The buffers of `state` the artifact's program reads at run time: placeholders of the
    program itself that something uses (None: no program)."""
    program = getattr(artifact, "program", None)
    if not state or not isinstance(program, torch.export.ExportedProgram):
        return None
    buffers = program.graph_signature.inputs_to_buffers
    return frozenset(
        buffers[n.name] for n in program.graph.nodes
        if n.op == "placeholder" and buffers.get(n.name) in state and n.users
    )


def program_state_still_read(before: frozenset[str] | None, artifact, state: frozenset[str]) -> Violation | None:
    """A violation naming the state the stage's input read at run time and its output no longer does."""
    after = state_read(artifact, state)
    lost = sorted(before - after) if before is not None and after is not None else []
    return _violation_if_any(
        lost,
        "another method of the program writes these buffers, and the stage's output no longer reads them "
        "at run time: it computes with their value at capture (a constant), not with what the other method wrote",
    )
