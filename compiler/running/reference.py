"""The reference executor: runs an emitted program whose delegates this machine's
ExecuTorch runtime lacks (MLX and Core ML exist only on Apple systems; the pip
runtime has neither).

It interprets the program's execution plan instruction by instruction, the way
ExecuTorch's `Method` does:

- the plan's values (EValues) become Python values: tensors (constants read
  from the program, the rest made when an op writes them), ints, floats,
  bools, lists;
- a kernel call runs the same operator in torch: `aten::add.out` is
  `torch.ops.aten.add.out` with the plan's arguments in schema order;
  ExecuTorch's own prim ops (symbolic int math, `et_view`) are done here;
- a delegate call runs the payload with its backend's delegate runner
  (`compiler.backends.delegate_runner`): MLX payloads with `mlx.core`, Core ML
  payloads with the MIL reference interpreter;
- moves and conditional jumps do what they say.

Like a loaded ExecuTorch `Method`, a `ReferenceExecutor` keeps each method's
memory, and each delegate its constants and state, from one `run` to the
next: state a program updates in place carries over between calls, on the
CPU and in the delegate. A new executor starts afresh.

Anything else (an operator torch does not have, a node type an interpreter
does not know, a delegate with no runner here) fails with a named error.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Callable, Sequence

import torch

from executorch.exir import schema

from compiler import backends
from compiler.ir.errors import CompileError, UnsupportedByRuntime
from compiler.ir.private_api import deserialize_pte

METHOD = "forward"

TORCH_DTYPES = {
    schema.ScalarType.BYTE: torch.uint8,
    schema.ScalarType.CHAR: torch.int8,
    schema.ScalarType.SHORT: torch.int16,
    schema.ScalarType.INT: torch.int32,
    schema.ScalarType.LONG: torch.int64,
    schema.ScalarType.HALF: torch.float16,
    schema.ScalarType.FLOAT: torch.float32,
    schema.ScalarType.DOUBLE: torch.float64,
    schema.ScalarType.BOOL: torch.bool,
    schema.ScalarType.BFLOAT16: torch.bfloat16,
    schema.ScalarType.COMPLEX64: torch.complex64,  # a real FFT's result (`_fft_r2c`), returned as it is
    schema.ScalarType.COMPLEX128: torch.complex128,
}


class ReferenceExecutionError(CompileError):
    """The reference executor cannot run (part of) this program."""


def _torch_dtype(scalar_type) -> torch.dtype:
    try:
        return TORCH_DTYPES[scalar_type]
    except KeyError:
        raise ReferenceExecutionError(f"the program uses scalar type {scalar_type!r}, unknown here") from None


# --- ExecuTorch's prim ops: symbolic int math and views, done in Python ------------------

# Each takes the argument values and returns the value written to the last argument.
_SCALAR_PRIMS: dict[str, Callable[..., Any]] = {
    "executorch_prim::add.Scalar": operator.add,
    "executorch_prim::sub.Scalar": operator.sub,
    "executorch_prim::mul.Scalar": operator.mul,
    "executorch_prim::floordiv.Scalar": operator.floordiv,
    "executorch_prim::truediv.Scalar": operator.truediv,
    "executorch_prim::mod.Scalar": operator.mod,
    "executorch_prim::mod.int": operator.mod,
    "executorch_prim::eq.Scalar": operator.eq,
    "executorch_prim::gt.Scalar": operator.gt,
    "executorch_prim::lt.Scalar": operator.lt,
    "executorch_prim::ge.Scalar": operator.ge,
    "executorch_prim::le.Scalar": operator.le,
    "executorch_prim::neg.Scalar": operator.neg,
    "executorch_prim::sym_float.Scalar": float,
    "executorch_prim::sym_max.Scalar": max,
    "executorch_prim::sym_min.Scalar": min,
    "executorch_prim::ceil.Scalar": math.ceil,
    "executorch_prim::round.Scalar": round,
    "executorch_prim::trunc.Scalar": math.trunc,
    "aten::sym_size.int": lambda tensor, dim: tensor.shape[dim],
    "aten::sym_numel": lambda tensor: tensor.numel(),
    "aten::sym_stride.int": lambda tensor, dim: tensor.stride(dim),
    "aten::sym_storage_offset": lambda tensor: tensor.storage_offset(),
    "aten::_local_scalar_dense": lambda tensor: tensor.item(),
}


def _empty_dim_order_out(size: Sequence[int], dtype=None, dim_order=None, *, out: torch.Tensor) -> None:
    """ExecuTorch's kernel only sizes `out` (its values are undefined); torch's Python
    implementation of this op passes a memory format along with `out=`, which torch refuses."""
    out.resize_(list(size))


# CPU kernels whose torch operator does not behave like ExecuTorch's kernel, done here.
_KERNELS_DONE_HERE: dict[str, Callable[..., None]] = {
    "dim_order_ops::_empty_dim_order.out": _empty_dim_order_out,
}


def _detached(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _copied(value: Any) -> Any:
    """A value as it is now, tensors (and lists of them) copied: for a tap."""
    return [_copied(v) for v in value] if isinstance(value, list) else _detached(value)


def _et_view(tensor: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    return tensor.reshape(list(sizes))


class _Method:
    """One execution plan, loaded once and run any number of times.

    Tensors the memory planner placed live in one byte arena per memory id, at
    their planned offsets, as in ExecuTorch: a view the emitter resolved to
    shared memory (no instruction at all) then sees what its base was given.
    """

    def __init__(self, executor: "ReferenceExecutor", plan: schema.ExecutionPlan) -> None:
        self.executor = executor
        self.plan = plan
        self.arenas = executor.arenas
        self.values: list[Any] = [self._initial(i) for i in range(len(plan.values))]

    # Values.
    def _planned(self, spec: schema.Tensor) -> torch.Tensor:
        dtype = _torch_dtype(spec.scalar_type)
        info = spec.allocation_info
        offset = info.memory_offset_low + (info.memory_offset_high << 32)
        nbytes = math.prod(spec.sizes) * torch.empty(0, dtype=dtype).element_size()
        region = self.arenas[info.memory_id][offset : offset + nbytes]
        return region.view(dtype).view(list(spec.sizes))

    def _initial(self, index: int) -> Any:
        val = self.plan.values[index].val
        if isinstance(val, schema.Tensor):
            constant = self.executor.constant_tensor(val)
            if constant is not None:
                return constant
            return self._planned(val) if val.allocation_info is not None else None
        if isinstance(val, schema.Int):
            return val.int_val
        if isinstance(val, schema.Bool):
            return val.bool_val
        if isinstance(val, schema.Double):
            return float(val.double_val)
        if isinstance(val, schema.String):
            return val.string_val
        if isinstance(val, (schema.DoubleList, schema.BoolList)):
            return list(val.items)
        return None  # Null; lists of other values are read when used (see `get`)

    def get(self, index: int) -> Any:
        val = self.plan.values[index].val
        if isinstance(val, schema.IntList):  # items are indices of Int values
            return [self.get(i) for i in val.items]
        if isinstance(val, schema.TensorList):
            return [self.get(i) for i in val.items]
        if isinstance(val, schema.OptionalTensorList):
            return [None if i < 0 else self.get(i) for i in val.items]
        return self.values[index]

    def out_tensor(self, index: int) -> torch.Tensor | list[torch.Tensor]:
        """The tensor(s) an out-variant kernel writes into."""
        spec = self.plan.values[index].val
        if isinstance(spec, schema.TensorList):
            return [self.out_tensor(i) for i in spec.items]
        if self.values[index] is None:  # not planned: torch sizes it
            self.values[index] = torch.empty(0, dtype=_torch_dtype(spec.scalar_type))
        elif spec.shape_dynamism != schema.TensorShapeDynamism.STATIC:
            # Planned at its upper bound; emptied so the kernel sizes it (within that bound).
            self.values[index].resize_(0)
        return self.values[index]

    def write(self, index: int, value: Any) -> None:
        """Store a delegate's output as ExecuTorch does: into the planned tensor."""
        current = self.values[index]
        spec = self.plan.values[index].val
        if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
            if current.shape != value.shape:
                static = spec.shape_dynamism == schema.TensorShapeDynamism.STATIC
                if static and value.numel() == current.numel():
                    # The delegate copies its elements into the program's tensor, as Core ML's
                    # does a rank-1 output into a 0-d tensor (Core ML has no 0-d outputs).
                    value = value.reshape(current.shape)
                elif static and value.numel() > current.numel():
                    raise ReferenceExecutionError(
                        f"a delegate returned shape {tuple(value.shape)} for program value {index}, "
                        f"whose shape is fixed at {tuple(current.shape)}: the payload computes more "
                        "elements than the program has room for (a conversion fault; a device cannot fit "
                        "them either)",
                        hint="keep the op that makes this output on the CPU, and report the model",
                    )
                else:
                    current.resize_(value.shape)  # within the planned size (a dynamic shape's bound)
            current.copy_(value)  # in the program's dtype (a Core ML float16 output becomes float32)
            return
        if isinstance(spec, schema.Tensor) and isinstance(value, torch.Tensor):
            value = value.to(_torch_dtype(spec.scalar_type))
        self.values[index] = value

    # Instructions.
    def run(self, inputs: Sequence[Any]) -> list[Any]:
        if len(inputs) != len(self.plan.inputs):
            raise ReferenceExecutionError(
                f"the program takes {len(self.plan.inputs)} inputs, got {len(inputs)}",
                hint="pass the same inputs as the example inputs it was compiled with",
            )
        for index, value in zip(self.plan.inputs, inputs):
            self.write(index, value)

        instructions = self.plan.chains[0].instructions
        tap = self.executor.tap
        pc = 0
        while pc < len(instructions):
            args = instructions[pc].instr_args
            pc += 1
            if isinstance(args, schema.KernelCall):
                written = self._kernel(args)
                if tap is not None:
                    tap(pc - 1, [_copied(self.get(i)) for i in args.args if i not in written],
                        [_copied(self.get(i)) for i in written])
            elif isinstance(args, schema.DelegateCall):
                given = self._delegate(args)
                if tap is not None:
                    tap(pc - 1, _copied(given), [_copied(self.get(i)) for i in args.args[len(given):]])
            elif isinstance(args, schema.MoveCall):
                self.values[args.move_to] = self.values[args.move_from]
            elif isinstance(args, schema.JumpFalseCall):
                if not self.get(args.cond_value_index):
                    pc = args.destination_instruction
            elif isinstance(args, schema.FreeCall):
                pass
            else:
                raise ReferenceExecutionError(f"unknown instruction {type(args).__name__} in the program")
        return [_detached(self.get(i)) for i in self.plan.outputs]

    def _kernel(self, call: schema.KernelCall) -> list[int]:
        """Run a kernel call; returns the indices of the values it wrote."""
        op = self.plan.operators[call.op_index]
        name = f"{op.name}.{op.overload}" if op.overload else op.name
        *inputs, result = call.args
        if name in _SCALAR_PRIMS or op.name in _SCALAR_PRIMS:
            function = _SCALAR_PRIMS.get(name) or _SCALAR_PRIMS[op.name]
            self.values[result] = function(*(self.get(i) for i in inputs))
            return [result]
        if name == "executorch_prim::et_view.default":
            self.values[result] = _et_view(self.get(inputs[0]), self.get(inputs[1]))
            return [result]
        overload = self.executor.torch_operator(op)
        values = []
        for argument, index in zip(overload._schema.arguments, call.args):
            if argument.is_out:
                values.append(self.out_tensor(index))
            else:
                values.append(self.get(index))
        positional = [v for a, v in zip(overload._schema.arguments, values) if not a.kwarg_only]
        keywords = {a.name: v for a, v in zip(overload._schema.arguments, values) if a.kwarg_only}
        try:
            _KERNELS_DONE_HERE.get(name, overload)(*positional, **keywords)
        except (RuntimeError, TypeError, ValueError, IndexError) as exc:
            raise ReferenceExecutionError(
                f"CPU kernel {name} failed in the reference executor: {str(exc).strip().splitlines()[0]}",
                nodes=[name],
                hint="the reference executor runs CPU kernels with torch's operator of the same name; "
                "where torch's out variant is stricter than ExecuTorch's kernel this is a limit of the "
                "reference executor, not of the program",
            ) from exc
        return [index for argument, index in zip(overload._schema.arguments, call.args) if argument.is_out]

    def _delegate(self, call: schema.DelegateCall) -> list[Any]:
        """Run a delegate call; returns the inputs it was given."""
        run = self.executor.delegate(self.plan, call.delegate_index)
        n_in = run.graph_inputs
        args = call.args
        given = [self.get(i) for i in args[:n_in]]
        outputs = run.execute(given)
        for index, value in zip(args[n_in:], outputs, strict=True):
            self.write(index, value)
        return given


class ReferenceExecutor:
    """A deserialized program and what it needs to run: constants, operators, payloads.

    `kv_cache` is the off-graph KV cache MLX `UpdateAndAttendNode`s use, which on a
    device the runner installs (see `compiler/backends/mlx/nodes_attention.py`).

    `tap`, when given, is called after each kernel and delegate call as
    `tap(instruction index, input values, output values)` (values copied: planned memory is
    reused by later instructions); `compiler.locate_program` reads a `.pte`'s values with it.
    """

    def __init__(self, pte: bytes, kv_cache: Any = None,
                 tap: Callable[[int, list[Any], list[Any]], None] | None = None, weights: bytes | None = None) -> None:
        """`weights`: the program's data file (`.ptd`), for a program whose weights are kept out of it."""
        self.tap = tap
        pte_file = deserialize_pte(pte)
        self.program = pte_file.program
        self.named_data: dict[str, bytes] = {}
        if pte_file.named_data is not None:
            buffers = pte_file.named_data.buffers
            for key, entry in pte_file.named_data.pte_data.items():
                self.named_data[key] = buffers[entry.buffer_index]
        if weights is not None:
            from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

            payload = FlatTensorSerializer().deserialize(weights)
            for key, entry in payload.named_data.items():
                self.named_data[key] = payload.buffers[entry.buffer_index]
        self.mutable_data = pte_file.mutable_data or []
        self.kv_cache = kv_cache
        self._delegates: dict[tuple[str, int], Any] = {}
        self._operators: dict[tuple[str, str], Any] = {}
        self._methods: dict[str, _Method] = {}
        # One arena per memory id for every method, the size of the largest, as ExecuTorch's
        # Python runtime gives the host-only methods of a program: the state a program of several
        # methods plans once (memory id 2, one offset) is then one state.
        sizes = [plan.non_const_buffer_sizes for plan in self.program.execution_plan]
        self.arenas = [
            torch.zeros(max(s[i] for s in sizes if i < len(s)), dtype=torch.uint8)
            for i in range(max(map(len, sizes), default=0))
        ]

    def plan(self, method: str) -> schema.ExecutionPlan:
        for plan in self.program.execution_plan:
            if plan.name == method:
                return plan
        names = [p.name for p in self.program.execution_plan]
        raise ReferenceExecutionError(f"the program has no method {method!r}", hint=f"it has: {', '.join(names)}")

    def run(self, inputs: Sequence[Any], method: str = METHOD) -> list[Any]:
        if method not in self._methods:
            self._methods[method] = _Method(self, self.plan(method))
        return self._methods[method].run(inputs)

    @property
    def computes_in_float16(self) -> bool:
        """Whether a delegate loaded so far computes in float16 (Core ML's default precision)."""
        return any(getattr(d, "computes_in_float16", False) for d in self._delegates.values())

    def constant_tensor(self, spec: schema.Tensor) -> torch.Tensor | None:
        dtype = _torch_dtype(spec.scalar_type)
        info = spec.extra_tensor_info
        data = None
        if info is not None and info.location == schema.TensorDataLocation.EXTERNAL:
            data = self.named_data.get(info.fully_qualified_name)
        elif spec.data_buffer_idx > 0:
            if spec.allocation_info is not None and self.mutable_data:
                data = self.mutable_data[spec.data_buffer_idx].storage  # a mutable buffer's first value
            else:
                data = self.program.constant_buffer[spec.data_buffer_idx].storage
        if data is None:
            return None
        count = math.prod(spec.sizes)
        if count == 0:  # torch.frombuffer refuses an empty buffer
            return torch.empty(list(spec.sizes), dtype=dtype)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        tensor = torch.frombuffer(bytearray(data[: count * itemsize]), dtype=dtype, count=count)
        return tensor.reshape(list(spec.sizes))

    def torch_operator(self, op: schema.Operator):
        key = (op.name, op.overload)
        if key not in self._operators:
            namespace, _, name = op.name.partition("::")
            packet = getattr(getattr(torch.ops, namespace, None), name, None) if name else None
            overload = getattr(packet, op.overload or "default", None) if packet is not None else None
            if overload is None:
                raise ReferenceExecutionError(
                    f"the program calls kernel {op.name}.{op.overload}, which torch does not have",
                    nodes=[f"{op.name}.{op.overload}"],
                    hint="the reference executor runs CPU kernels with their torch operator of the same name",
                )
            self._operators[key] = overload
        return self._operators[key]

    def delegate(self, plan: schema.ExecutionPlan, index: int) -> Any:
        """The runner of the plan's `index`th delegate, made on first use (the
        runtime's `init`); it keeps its state from call to call."""
        key = (plan.name, index)
        if key not in self._delegates:
            delegate = plan.delegates[index]
            runner = backends.delegate_runner(delegate.id)
            if runner is None:
                raise UnsupportedByRuntime(
                    f"the reference executor cannot run a {delegate.id} delegate",
                    hint=f"run the program on {backends.runs_on(delegate.id)}",
                )
            if delegate.processed.location != schema.DataLocation.INLINE:
                raise ReferenceExecutionError(f"the {delegate.id} delegate's payload is not in the program")
            payload = self.program.backend_delegate_data[delegate.processed.index].data
            self._delegates[key] = runner(bytes(payload), self)
        return self._delegates[key]


def run_program(pte: bytes, inputs: list) -> list[torch.Tensor]:
    """Run the `.pte` bytes' forward method on `inputs`; returns its outputs."""
    return ReferenceExecutor(pte).run(inputs)
