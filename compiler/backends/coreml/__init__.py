"""The Core ML backend: ExecuTorch's Core ML delegate with our refusal rules and conversion fixes.

Options are those of ExecuTorch's `CoreMLPartitioner`, with the same names and
meaning (`compile_specs`, `skip_ops_for_coreml_delegation`,
`take_over_mutable_buffer`, `take_over_constant_data`, `lower_full_graph`),
plus `minimum_deployment_target` (a `coremltools.target` or its name, e.g.
"iOS18") and `compute_precision` (a `coremltools.precision` or "float16" /
"float32"), each written into the compile specs, so the CLI can set them.

- `rules.py`: every reason an op stays on the CPU, one predicate each;
- `quantized.py`: the deployment target a quantized program's ops need; given none, the
  backend sets it (as ExecuTorch's Core ML recipes do), given a lower one, refuses;
- `rank.py`: shape-only chains through rank > 5 rewritten at rank <= 5 before the search;
- `search.py`: the partition search that asks them;
- `conversion.py`: fixes to coremltools' conversion, installed by `lowering()`;
- `payload.py`: reads a Core ML payload back (its MIL program), for checks and tests, and
  makes the payloads `lowering()` builds reproducible (no random identifiers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Any, Iterable, Optional

import attrs
import coremltools as ct
import torch
from torch.export import ExportedProgram

from executorch.backends.apple.coreml.compiler import CoreMLBackend as _ExecutorchCoreMLBackend
from executorch.backends.apple.coreml.compiler.coreml_preprocess import COMPILE_SPEC_KEYS
from executorch.backends.apple.coreml.partition import CoreMLPartitioner
from executorch.exir.backend.compile_spec_schema import CompileSpec
from executorch.exir.backend.partitioner import DelegationSpec

from compiler.reporting import progress
from compiler.backends.base import Backend, BackendPartition, KeepWhole
from compiler.backends.coreml import conversion, payload, pieces, quantized, rank, rules, search
from compiler.backends.coreml.conversion import CoreMLConversionError
from compiler.process.collector import collect
from compiler.ir.dialect import op_name
from compiler.ir.errors import CompileError, UserInputError
from compiler.ir.graph import DELEGATION_TAG, op_nodes, state_not_starting_at_zero
from compiler.ir.targets import STATIC
from compiler.ir.private_api import (
    coreml_conversion_state_reset_on_failure,
    coreml_temporary_packages_removed,
    coreml_payloads_rewritten,
    coreml_progress_bars,
    fp16_overflow_checked_in_pieces,
    mil_idle_work_skipped,
    mil_pass_validation_skipped,
    preprocess_copies_share_tensors,
)

BACKEND_ID = _ExecutorchCoreMLBackend.__name__
STAGE = "partition"

logger = logging.getLogger(__name__)


def _reproducible(result: Any) -> Any:
    """The result with `payload.reproducible` bytes, after a collection: coremltools leaves the
    program it converted (its weights included) in reference cycles, and the rewrite makes a copy
    of the payload. Freed first, that program makes room for the copy instead of the copy raising
    the peak (Core ML, depth-24 stack: the lower stage's peak heap 261 MB -> 227 MB; stock's 229).
    A large payload then becomes the program's named data (`payload.stored_as_named_data`)."""
    collect()
    return payload.stored_as_named_data(dataclasses.replace(result, processed_bytes=payload.reproducible(result.processed_bytes)))


class CoreMLRefusal(CompileError):
    """`lower_full_graph=True`, but Core ML refuses some ops."""


class CoreMLStateSplit(CompileError):
    """A mutable buffer Core ML would take over is also used on the CPU."""


def _integer_buffers(program: ExportedProgram) -> set[str]:
    """The non-float mutable buffers: Core ML state is float16 only (coremltools casts a buffer
    to it), which holds integers exactly up to 2048 only: transformers' StaticCache counts the
    tokens written in an int64 buffer (and as state, coremltools' canonicalize_inplace_pattern
    pass failed on it: KeyError on a coreml_update_state it had removed)."""
    values = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
    return {
        spec.target for spec in program.graph_signature.input_specs
        if spec.target in program.graph_signature.buffers_to_mutate.values()
        and isinstance(values.get(spec.arg.name), torch.Tensor) and not values[spec.arg.name].dtype.is_floating_point
    }


def _deployment_target(value: Any) -> Optional[ct.target]:
    if value is None or isinstance(value, ct.target):
        return value
    try:
        if isinstance(value, str):
            return ct.target[value] if value in ct.target.__members__ else ct.target(int(value))
        return ct.target(int(value))
    except (KeyError, ValueError) as exc:
        raise UserInputError(
            f"minimum_deployment_target {value!r} is not a coremltools target",
            hint=f"use one of: {', '.join(ct.target.__members__)}",
        ) from exc


def _target_from_specs(specs: Iterable[CompileSpec]) -> Optional[ct.target]:
    return _ExecutorchCoreMLBackend.min_deployment_target_from_compile_specs(list(specs))


def _compute_precision(value: Any) -> Optional[ct.precision]:
    if value is None or isinstance(value, ct.precision):
        return value
    try:
        return ct.precision(str(value).lower())
    except ValueError as exc:
        raise UserInputError(
            f"compute_precision {value!r} is not a Core ML compute precision",
            hint=f"use one of: {', '.join(p.value for p in ct.precision)}",
        ) from exc


# Backend options that stand for one compile spec each, so the CLI can set them:
# option -> (the spec's key, option value -> spec, specs -> the value they hold).
_SPEC_OPTIONS = {
    "minimum_deployment_target": (
        COMPILE_SPEC_KEYS.MIN_DEPLOYMENT_TARGET.value,
        _ExecutorchCoreMLBackend.generate_minimum_deployment_target_compile_spec,
        _target_from_specs,
    ),
    "compute_precision": (
        COMPILE_SPEC_KEYS.MODEL_COMPUTE_PRECISION.value,
        _ExecutorchCoreMLBackend.generate_compute_precision_compile_spec,
        _ExecutorchCoreMLBackend.model_compute_precision_from_compile_specs,
    ),
}


def _with_spec_option(specs: list[CompileSpec], option: str, value: Any) -> list[CompileSpec]:
    """`specs` with the spec `option` stands for, unless they hold it already (then the two must agree)."""
    if value is None:
        return specs
    key, make, read = _SPEC_OPTIONS[option]
    if not any(s.key == key for s in specs):
        return [*specs, make(value)]
    if read(specs) != value:
        raise UserInputError(
            f"{option}={getattr(value, 'name', value)} disagrees with the one in compile_specs "
            f"({getattr(read(specs), 'name', read(specs))})",
            hint=f"give the {option} once",
        )
    return specs


class CoreMLBackend(Backend):
    name = "coreml"
    refusal_rules = rules.NODE_RULES
    refused_input_dtypes = rules.REFUSED_DTYPES
    no_llm_ops = (
        "ExecuTorch has no Core ML LLM ops: Core ML keeps the static cache as its own state (iOS 18) and "
        "converts the attention itself"
    )

    @classmethod
    def pt2e_quantizer(cls, scheme, granularity: str):
        from compiler.backends.coreml.quantizer import pt2e_quantizer

        return pt2e_quantizer(scheme.activations == STATIC)

    @classmethod
    def float32_options(cls):
        return {"compile_specs": [_ExecutorchCoreMLBackend.generate_compute_precision_compile_spec(ct.precision.FLOAT32)]}

    @classmethod
    def share_method_weights(cls, lowered):
        """The weights methods share, in one multifunction model."""
        from compiler.backends.coreml import multifunction

        return multifunction.share_weights(lowered)

    def __init__(
        self,
        *,
        compile_specs: Optional[list[CompileSpec]] = None,
        skip_ops_for_coreml_delegation: Optional[list[str]] = None,
        take_over_mutable_buffer: bool = True,
        take_over_constant_data: bool = True,
        lower_full_graph: bool = False,
        minimum_deployment_target: Any = None,
        compute_precision: Any = None,
        piece_weight_mb: int = pieces.PIECE_WEIGHT_BYTES >> 20,
    ) -> None:
        """`piece_weight_mb`: a partition holding more weights is cut into pieces holding about
        this many MiB each, which coremltools converts one at a time (0: never cut)."""
        skipped = list(skip_ops_for_coreml_delegation or [])
        if lower_full_graph and (skipped or not take_over_constant_data or not take_over_mutable_buffer):
            raise UserInputError(
                "lower_full_graph=True cannot be combined with skip_ops_for_coreml_delegation, "
                "take_over_constant_data=False or take_over_mutable_buffer=False",
                hint="drop those options, or let ops Core ML refuses run on the CPU",
                suggest={"lower_full_graph": False},
            )
        specs = list(compile_specs or [])
        specs = _with_spec_option(specs, "minimum_deployment_target", _deployment_target(minimum_deployment_target))
        specs = _with_spec_option(specs, "compute_precision", _compute_precision(compute_precision))
        if any(s.key == COMPILE_SPEC_KEYS.ENUMERATED_SHAPES.value for s in specs) and not lower_full_graph:
            raise UserInputError(
                "enumerated shapes in compile_specs need lower_full_graph=True",
                hint="enumerated shapes need the whole graph in Core ML",
                suggest={"lower_full_graph": True},
            )
        self.compile_specs = specs
        self.skip_ops_for_coreml_delegation = skipped
        self.take_over_mutable_buffer = take_over_mutable_buffer
        self.take_over_constant_data = take_over_constant_data
        self.lower_full_graph = lower_full_graph
        self.piece_weight_bytes = int(piece_weight_mb) << 20
        self.rule_context = rules.RuleContext(
            minimum_deployment_target=_target_from_specs(specs),
            skipped_ops=frozenset(rules.normalise_op_name(op) for op in skipped),
        )
        self.delegation_spec = DelegationSpec(BACKEND_ID, specs)

    def _for_program(self, program: ExportedProgram) -> tuple[rules.RuleContext, DelegationSpec]:
        """The rule context and delegation spec for `program`: with the deployment target its
        quantized ops need (`quantized.py`) when none was given, as ExecuTorch's Core ML recipes
        set it; a target given below that is a `UserInputError`, as in the recipes."""
        need = quantized.program_need(program)
        given = self.rule_context.minimum_deployment_target
        if need is None or (given is not None and given >= need.target):
            return self.rule_context, self.delegation_spec
        if given is not None:
            raise UserInputError(
                f"minimum_deployment_target={given.name} is below {need.target.name}, which the quantized "
                f"op {need.node} ({need.op}) needs: {need.why}",
                nodes=[need.node],
                hint=f"set minimum_deployment_target={need.target.name} or later, or leave it unset "
                f"(the Core ML backend then sets {need.target.name})",
                suggest={"minimum_deployment_target": need.target.name},
            )
        logger.info("coreml: minimum_deployment_target %s, for %s (%s)", need.target.name, need.node, need.op)
        specs = _with_spec_option(self.compile_specs, "minimum_deployment_target", need.target)
        context = attrs.evolve(self.rule_context, minimum_deployment_target=need.target)
        return context, DelegationSpec(BACKEND_ID, specs)

    # --- what to keep whole -----------------------------------------------------------

    def keep_whole(self, program: ExportedProgram) -> KeepWhole:
        stock = CoreMLPartitioner(
            skip_ops_for_coreml_delegation=self.skip_ops_for_coreml_delegation,
            compile_specs=None,
            take_over_mutable_buffer=self.take_over_mutable_buffer,
            take_over_constant_data=self.take_over_constant_data,
        )
        ops, _ = stock.ops_to_not_decompose(program)
        context, _ = self._for_program(program)
        return KeepWhole(frozenset(ops), functools.partial(self._may_keep_whole, context))

    @staticmethod
    def _may_keep_whole(context: rules.RuleContext, node: torch.fx.Node) -> bool:
        """Keep whole only nodes no rule sends to the CPU (a kept-whole op on the CPU may have no kernel)."""
        if rules.refusal(node, context):
            return False
        touched = rules.tensor_dtypes(node).union(*(rules.tensor_dtypes(a) for a in node.all_input_nodes))
        return not touched & rules.REFUSED_DTYPES

    def dry_run_needed(self, program: ExportedProgram, kept: list[torch.fx.Node]) -> str | None:
        """The partition rules that can move a kept node to the CPU need a refused dtype (float16
        before iOS 16), a size that is an expression of symbols, a skip list, a rank above Core
        ML's limit, or (before iOS 18) a kept node that reads no model input, whose partition may
        have no input; without them, every node the keep-whole filter accepts is taken."""
        if self.skip_ops_for_coreml_delegation:
            return "you gave skip_ops_for_coreml_delegation"
        context, _ = self._for_program(program)
        refused = rules.REFUSED_DTYPES | (set() if context.ios16 else {torch.float16})
        for node in program.graph.nodes:
            sizes = rules.size_expressions(node)
            if sizes:
                return f"{node.name} is sized {sizes[0]}, which Core ML takes from outside a partition only as one symbol"
            for value in rules.tensor_values(node):
                if value.dtype in refused:
                    return f"{node.name} is {value.dtype}, which Core ML refuses (before iOS 16 for float16)"
                if value.dim() > rules.CORE_ML_MAX_RANK:
                    return f"{node.name} has rank {value.dim()}, above Core ML's {rules.CORE_ML_MAX_RANK}"
        if not context.ios18:
            user_inputs = set(program.graph_signature.user_inputs)  # a property that rebuilds its tuple
            fed = {n for n in program.graph.nodes if n.name in user_inputs}
            for node in program.graph.nodes:
                if node not in fed and any(a in fed for a in node.all_input_nodes):
                    fed.add(node)
            lonely = next((n for n in kept if n not in fed), None)
            if lonely is not None:
                return f"{lonely.name} reads no model input; a Core ML partition without inputs needs iOS 18"
        return None

    # --- partition --------------------------------------------------------------------

    def partition(self, program: ExportedProgram) -> BackendPartition:
        # The program is the partition stage's own copy: chains through rank > 5 that can be
        # written at rank <= 5 are, so Core ML takes them (the rank rule refuses the rest).
        rank.reduce_rank(program)
        context, delegation_spec = self._for_program(program)
        result = search.search(program, context, self.take_over_constant_data, self.take_over_mutable_buffer)
        if self.lower_full_graph:
            self._refuse_any_cpu_op(program, result)
        notes: list[str] = []
        if self.piece_weight_bytes and not self.lower_full_graph:
            cut, notes = pieces.cut(program, result.partitions, self.piece_weight_bytes)
            result = attrs.evolve(result, partitions=cut)
        tags = search.tag(result)
        copied = search.copy_size_reads(program)
        if copied:
            logger.info("coreml: %d dynamic size read(s) copied into the partitions that use them", copied)
        if self.take_over_constant_data:
            search.tag_constants(program)
        if self.take_over_mutable_buffer:
            self._tag_state(program, context)
        reasons = {node.name: reason for node, reason in result.refused.items()}
        return BackendPartition({t: delegation_spec for t in tags}, reasons, tuple(notes))

    def _refuse_any_cpu_op(self, program: ExportedProgram, result: search.SearchResult) -> None:
        inside = {n for p in result.partitions for n in p.nodes}
        refused = [n for n in op_nodes(program) if n not in inside]
        if not refused:
            return
        details = [
            f"{n.name} ({op_name(n.target)}, reading {', '.join(a.name for a in n.all_input_nodes) or 'nothing'}): "
            f"{result.refused.get(n, self.default_cpu_reason(n))}"
            for n in refused
        ]
        first = refused[0]
        raise CoreMLRefusal(
            f"lower_full_graph=True, but Core ML cannot take {len(refused)} op(s); first: "
            f"{op_name(first.target)} ({details[0].split(': ', 1)[1]})\n    " + "\n    ".join(details),
            stage=STAGE,
            nodes=[n.name for n in refused],
            hint="run them on the CPU, or rewrite the model to avoid them",
            suggest={"lower_full_graph": False},
        )

    def _tag_state(self, program: ExportedProgram, context: rules.RuleContext) -> None:
        """Core ML takes a mutable buffer over as state only if every op using it is in one
        partition, only if it starts at zero (the payload carries no initial value for state,
        like MLX's, while a CPU-owned buffer is emitted with it) and only if it is a float
        buffer (`_integer_buffers`); other buffers the delegate reads and returns."""
        signature = program.graph_signature
        starts_elsewhere = {target for _, target in state_not_starting_at_zero(program)}
        mutated = set(signature.buffers_to_mutate.values()) - starts_elsewhere - _integer_buffers(program)
        writers = {target: name for name, target in signature.buffers_to_mutate.items()}
        nodes = {n.name: n for n in program.graph.nodes}
        for spec in signature.input_specs:
            if spec.target not in mutated:
                continue
            buffer = nodes[spec.arg.name]
            touching = [u for u in buffer.users if u.op == "call_function"]
            writer = nodes.get(writers.get(spec.target, ""))
            if writer is not None and writer.op == "call_function":
                # The new value is the state too: ops reading it count as using the buffer.
                for node in [writer, *writer.users]:
                    if node.op == "call_function" and node not in touching:
                        touching.append(node)
            where = {u.meta.get(DELEGATION_TAG) for u in touching}
            if where == {None} or not where:
                continue  # state only the CPU uses stays on the CPU
            if len(where) == 1 and None not in where:
                if not context.ios18:
                    # Stock refuses ('State model is supported only >= iOS18'); the delegate
                    # reads the buffer and returns its new value instead.
                    logger.info("coreml: %s stays a CPU buffer (Core ML state needs iOS 18)", spec.target)
                    continue
                buffer.meta[DELEGATION_TAG] = where.pop()
                continue
            placed = [f"{u.name} ({op_name(u.target)}) on {u.meta.get(DELEGATION_TAG) or 'cpu'}" for u in touching]
            raise CoreMLStateSplit(
                f"the mutable buffer {spec.target!r} would become Core ML state, but it is used both "
                f"in Core ML and elsewhere: {'; '.join(placed)}",
                stage=STAGE,
                nodes=[u.name for u in touching],
                hint="keep the buffer on the CPU, or make the ops that use it run in Core ML",
                suggest={"take_over_mutable_buffer": False},
            )

    def default_cpu_reason(self, node: torch.fx.Node) -> str:
        return f"Core ML's partitioner left {op_name(node.target)} out of every delegate (no rule refused it)"

    # --- lowering ---------------------------------------------------------------------

    def lowering(self, dependency_checks: bool = False):
        """Our conversion fixes, coremltools' progress bars as steps of the lower stage's line,
        payloads made reproducible (`payload.reproducible`: content-derived identifiers instead
        of stock's random ones), and (unless `dependency_checks`) no MIL validation after each
        of coremltools' passes, nor the work coremltools repeats after each pass that changes nothing
        (`mil_idle_work_skipped`), nor a copy of every weight for the conversion, which only
        reads them (`preprocess_copies_share_tensors`), nor whole-weight temporaries in the float16
        pass's overflow test (`fp16_overflow_checked_in_pieces`). A conversion that fails leaves no coremltools naming state
        behind (`coreml_conversion_state_reset_on_failure`): later payloads stay reproducible. No
        converted package stays on disk once its payload is made (`coreml_temporary_packages_removed`)."""
        stack = contextlib.ExitStack()
        stack.enter_context(coreml_conversion_state_reset_on_failure())
        stack.enter_context(coreml_temporary_packages_removed())
        stack.enter_context(conversion.installed())
        stack.enter_context(coreml_payloads_rewritten(_reproducible))
        stack.enter_context(coreml_progress_bars(progress.steps))
        stack.enter_context(mil_idle_work_skipped())
        stack.enter_context(fp16_overflow_checked_in_pieces())
        stack.enter_context(preprocess_copies_share_tensors())
        if not dependency_checks:
            stack.enter_context(mil_pass_validation_skipped())
        return stack


__all__ = ["CoreMLBackend", "CoreMLConversionError", "CoreMLRefusal", "CoreMLStateSplit"]
