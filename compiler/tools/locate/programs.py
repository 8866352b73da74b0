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
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from compiler.ir.errors import UserInputError

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


class _Interpreter(torch.fx.Interpreter):
    """Runs the graph node by node, keeping each node's value when asked; a delegate call
    goes to `delegate(lowered_module, args)`."""

    def __init__(self, module: torch.fx.GraphModule, delegate: Callable | None, keep: bool) -> None:
        super().__init__(module, garbage_collect_values=not keep)
        self.delegate = delegate
        self.keep = keep
        self.values: dict[str, Any] = {}

    def run_node(self, node: torch.fx.Node) -> Any:
        value = super().run_node(node)
        if self.keep:
            self.values[node.name] = value
        return value

    def call_function(self, target, args, kwargs):
        if getattr(target, "__name__", None) == "executorch_call_delegate":
            if self.delegate is None:
                raise UserInputError("this program calls a delegate, which nothing here runs")
            return self.delegate(args[0], args[1:])
        return super().call_function(target, args, kwargs)


class DelegateRunner:
    """Runs each lowered module of a program alone, on ExecuTorch's runtime or the reference
    executor (whichever `LoadedProgram` picks for its delegate), loaded once per module."""

    def __init__(self) -> None:
        self._loaded: dict[int, Any] = {}
        self.computes_in: list[torch.dtype | None] = []
        self.float16 = False

    def __call__(self, lowered: Any, args: Sequence[Any]) -> tuple[Any, ...]:
        from compiler.running.runtime import LoadedProgram

        key = id(lowered)
        if key not in self._loaded:
            self._loaded[key] = (lowered, LoadedProgram(lowered.buffer()))
        loaded = self._loaded[key][1]
        outputs = loaded([a for a in args if a is not None])
        self.computes_in.append(loaded.computes_in)
        self.float16 = self.float16 or loaded.computes_in_float16
        return tuple(outputs)


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
