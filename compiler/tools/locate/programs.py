"""Running one stage's program on given inputs, keeping every node's value when asked.

An ExportedProgram (ATen, Edge, partitioned, lowered) runs in a `torch.fx.Interpreter` over
its own graph, its lifted weights given as placeholders, so node names stay the program's
own and every intermediate value can be read by name. A lowered program's delegate calls run
each delegate alone: the delegate's own one-call program (`LoweredBackendModule.buffer()`) in
a `LoadedProgram`, which uses ExecuTorch's runtime where it has the delegate (XNNPACK) and the
reference executor's runner otherwise (Core ML, MLX), so the lowered stage's numbers are the
payloads' own. The emitted `.pte` runs whole in a `LoadedProgram`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec, OutputKind
from torch.utils import _pytree as pytree

from executorch.exir.lowered_backend_module import LoweredBackendModule

from compiler.ir.errors import CompileError, UserInputError
from compiler.ir.private_api import delegate_named_data

logger = logging.getLogger(__name__)


@attrs.frozen
class ProgramRun:
    """A program's user outputs on the inputs, what it computes in, and (when kept) each node's
    value by name. `delegate_inputs`: delegate call node -> the values it was given."""

    outputs: tuple[Any, ...]
    computes_in: torch.dtype | None = None
    computes_in_float16: bool = False
    values: Mapping[str, Any] = attrs.field(factory=dict, repr=False)


def least_precise(dtypes: Any) -> torch.dtype | None:
    """The floating dtype with the fewest significand bits among `dtypes` (None for none)."""
    floating = [d for d in dtypes if d is not None and d.is_floating_point]
    return max(floating, key=lambda d: torch.finfo(d).eps, default=None)


def user_leaves(inputs: Sequence[Any]) -> list[Any]:
    return list(pytree.tree_leaves(tuple(inputs)))


def placeholder_values(program: ExportedProgram, inputs: Sequence[Any]) -> list[Any]:
    """The values of the program's placeholders in order: its weights and constants (buffers
    cloned, so a run never changes the kept stage's state) and the flattened user inputs."""
    given = iter(user_leaves(inputs))
    values = []
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            try:
                values.append(next(given))
            except StopIteration:
                raise UserInputError(
                    "the inputs are fewer than the program's", hint="give the inputs the model was compiled with"
                ) from None
        elif spec.kind == InputKind.PARAMETER:
            values.append(program.state_dict[spec.target])
        elif spec.kind == InputKind.BUFFER:
            held = program.state_dict.get(spec.target, program.constants.get(spec.target))
            values.append(held.clone() if isinstance(held, torch.Tensor) else held)
        elif spec.kind in (InputKind.CONSTANT_TENSOR, InputKind.CUSTOM_OBJ):
            held = program.constants[spec.target]
            values.append(held.clone() if isinstance(held, torch.Tensor) else held)
        else:  # a token: effects are ordered by the graph, nothing to give
            values.append(None)
    return values


class PayloadRefused(CompileError):
    """A delegate's payload that its runner refuses to run (a `CompileError` of the runner's:
    `MilInterpreterError`, `AliasedPayloadOutput`, `BadMLXPayload`...): the delegate call node,
    its lowered module, and the runner's error (`refusal`)."""

    def __init__(self, call: str, lowered: Any, refusal: CompileError) -> None:
        super().__init__(
            f"the {lowered.backend_id} payload of delegate call {call} cannot run: {refusal.reason}",
            nodes=[call], hint=refusal.hint,
        )
        self.call, self.lowered, self.refusal = call, lowered, refusal


class _Interpreter(torch.fx.Interpreter):
    """Runs the graph node by node, keeping each node's value when asked; a delegate call
    goes to `delegate(lowered_module, args)`, and a runner's refusal of its payload is raised
    as `PayloadRefused`."""

    def __init__(self, module: torch.fx.GraphModule, delegate: Callable | None, keep: bool) -> None:
        super().__init__(module, garbage_collect_values=not keep)
        self.delegate = delegate
        self.keep = keep
        self.values: dict[str, Any] = {}

    def run_node(self, node: torch.fx.Node) -> Any:
        try:
            value = super().run_node(node)
        except CompileError as exc:
            if getattr(node.target, "__name__", None) == "executorch_call_delegate" and not _runner_limit(exc):
                raise PayloadRefused(node.name, getattr(self.module, node.args[0].target), exc) from exc
            raise
        if self.keep:
            self.values[node.name] = value
        return value

    def call_function(self, target, args, kwargs):
        if getattr(target, "__name__", None) == "executorch_call_delegate":
            if self.delegate is None:
                raise UserInputError("this program calls a delegate, which nothing here runs")
            return self.delegate(args[0], args[1:])
        return super().call_function(target, args, kwargs)


def _runner_limit(exc: CompileError) -> bool:
    """An error that says what the runner lacks (`UnsupportedMilOp`, `UnsupportedMLXNode`,
    `UnsupportedByRuntime`), not what is wrong with the payload; or one already wrapped."""
    return isinstance(exc, PayloadRefused) or any(c.__name__.startswith("Unsupported") for c in type(exc).__mro__)


def _one_call_pte(lowered: Any) -> bytes:
    """The delegate's own one-call program (`LoweredBackendModule.buffer()`). Stock's
    `program()` drops from it the parameters and buffers the delegate took, but not the lifted
    tensor constants (a folded weight), and then fails ('Number of inputs changed after
    transformation'): a stand-in of the lowered module whose original program names those
    constants buffers makes the same program."""
    original = lowered.original_module
    signature = original.graph_signature
    taken = [s for s in signature.input_specs if s.kind == InputKind.CONSTANT_TENSOR]
    if taken:
        specs = [
            InputSpec(InputKind.BUFFER, s.arg, s.target, persistent=True) if s in taken else s
            for s in signature.input_specs
        ]
        stand_in = ExportedProgram(
            root=original.graph_module, graph=original.graph,
            graph_signature=ExportGraphSignature(specs, list(signature.output_specs)),
            state_dict={**original.state_dict, **{s.target: original.constants[s.target] for s in taken}},
            range_constraints=original.range_constraints, module_call_graph=original.module_call_graph,
            constants={k: v for k, v in original.constants.items() if k not in {s.target for s in taken}},
            verifiers=[original.verifier],
        )
        lowered = LoweredBackendModule(
            stand_in, lowered.backend_id, lowered.processed_bytes, lowered.compile_specs,
            lowered.named_data_store_output,
        )
    return lowered.buffer()


class _PayloadRunner:
    """A delegate run by its reference runner on its payload directly, for a lowered module of
    which stock cannot make a one-call program (its memory planning guards on a data-dependent
    size): as the reference executor runs it, each output in the program's dtype."""

    def __init__(self, lowered: Any, runner: type) -> None:
        executor = _Executor(delegate_named_data(lowered))
        self.run = runner(bytes(lowered.processed_bytes), executor)
        outputs = lowered.original_module.graph.output_node().args[0]
        self.dtypes = [getattr(n.meta.get("val"), "dtype", None) if isinstance(n, torch.fx.Node) else None for n in outputs]
        given = [n.meta.get("val") for n in lowered.original_module.graph.nodes if n.op == "placeholder"]
        self.computes_in = least_precise(
            getattr(v, "dtype", None) for v in [*given, *(n.meta.get("val") for n in outputs if isinstance(n, torch.fx.Node))]
        )

    @property
    def computes_in_float16(self) -> bool:
        return bool(getattr(self.run, "computes_in_float16", False))

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        outputs = self.run.execute(list(inputs))
        return [
            o.to(d) if isinstance(o, torch.Tensor) and d is not None else o
            for o, d in zip(outputs, self.dtypes + [None] * len(outputs))
        ]


@attrs.frozen
class _Executor:
    """What a reference runner reads of its executor: the program's named data, no KV cache."""

    named_data: Mapping[str, bytes]
    kv_cache: Any = None


class DelegateRunner:
    """Runs each lowered module of a program alone, on ExecuTorch's runtime or the reference
    executor (whichever `LoadedProgram` picks for its delegate), loaded once per module; a
    module stock makes no one-call program of runs on its reference runner, where it has one."""

    def __init__(self) -> None:
        self._loaded: dict[int, Any] = {}
        self.computes_in: list[torch.dtype | None] = []
        self.float16 = False

    def __call__(self, lowered: Any, args: Sequence[Any]) -> tuple[Any, ...]:
        key = id(lowered)
        if key not in self._loaded:
            self._loaded[key] = (lowered, self._load(lowered))
        loaded = self._loaded[key][1]
        # A weight the delegate reads but did not take is a Parameter, which the runtime refuses.
        outputs = loaded([a.detach() if isinstance(a, torch.nn.Parameter) else a for a in args if a is not None])
        self.computes_in.append(loaded.computes_in)
        self.float16 = self.float16 or loaded.computes_in_float16
        return tuple(outputs)

    @staticmethod
    def _load(lowered: Any) -> Any:
        from compiler import backends
        from compiler.running.runtime import LoadedProgram

        try:
            pte = _one_call_pte(lowered)
        except CompileError:
            raise
        except Exception as exc:  # stock's emission of the one-call program, which has many ways to fail
            runner = backends.delegate_runner(lowered.backend_id)
            if runner is None:
                raise
            logger.info("locate: no one-call program of the %s delegate (%s: %s); running its payload directly",
                        lowered.backend_id, type(exc).__name__, str(exc).splitlines()[0])
            return _PayloadRunner(lowered, runner)
        return LoadedProgram(pte)


def _node_dtypes(program: ExportedProgram) -> list[torch.dtype]:
    dtypes = []
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        for value in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(value, torch.Tensor):
                dtypes.append(value.dtype)
    return dtypes


def run_exported(program: ExportedProgram, inputs: Sequence[Any], keep: bool = False) -> ProgramRun:
    """Run an ExportedProgram's graph on `inputs`; its user outputs (mutated buffers left out)."""
    delegates = DelegateRunner()
    interpreter = _Interpreter(program.graph_module, delegates, keep)
    with torch.no_grad():
        flat = interpreter.run(*placeholder_values(program, inputs), enable_io_processing=False)
    flat = list(flat) if isinstance(flat, (tuple, list)) else [flat]
    outputs = tuple(
        value for value, spec in zip(flat, program.graph_signature.output_specs) if spec.kind == OutputKind.USER_OUTPUT
    )
    cpu = [d for d in _node_dtypes(program)]
    return ProgramRun(
        outputs, least_precise([*cpu, *delegates.computes_in]), delegates.float16, interpreter.values
    )


def run_pte(program: Any, inputs: Sequence[Any]) -> ProgramRun:
    """Run an emitted program (whole) on `inputs`."""
    from compiler.running.runtime import LoadedProgram

    loaded = LoadedProgram(program)
    outputs = loaded(inputs)
    return ProgramRun(tuple(outputs), loaded.computes_in, loaded.computes_in_float16)


def run_eager(module: torch.nn.Module, inputs: Sequence[Any]) -> tuple[Any, ...]:
    """The eager model's flattened outputs; its buffers are as before afterwards."""
    buffers = list(module.buffers())
    before = [b.clone() for b in buffers]
    try:
        with torch.no_grad():
            outputs = module(*inputs)
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, before):
                buffer.copy_(value)
    return tuple(x for x in pytree.tree_leaves(outputs))
