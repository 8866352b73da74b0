"""Random valid programs for differential testing, drawn with hypothesis.

A program is Python source: a `torch.nn.Module` whose forward is a few lines, each
an op picked from a catalogue of what our stages and backends treat specially. Every
line is run eagerly while it is drawn, so each value's shape and dtype are known
exactly and every program runs; hypothesis shrinks a failing program to its shortest
form, and the source is its own standalone reproducer.

Each value carries `noise`, a bound on the relative rounding error eager and a
compiled program may legitimately disagree by. Steps whose result jumps on a tiny
difference (comparisons, float-to-int casts, rounding, argmax) only take values whose
noise is small, so a mismatch on them is a real bug, not a coin flip.
"""

from __future__ import annotations

import functools
import math
import types
from typing import Callable

import attrs
import torch
from hypothesis import strategies as st

from compiler.ir import targets
from compiler.stages import schemes

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTEGERS = (torch.int64, torch.int32, torch.int8, torch.uint8)
DTYPES = FLOATS + INTEGERS + (torch.bool,)
# Relative rounding error one float op in each dtype may add (generous: backends
# approximate transcendental functions and accumulate in other orders).
OP_NOISE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Steps that jump on a tiny difference only take values at most this noisy.
EXACT_ENOUGH = 2e-5
# Every float value of a quantized program is this noisy: a quantizer may round any float op's
# activations (static schemes), so a compiled program may land a step away from eager's.
QUANTIZED_NOISE = 1e-2
@attrs.frozen
class Sizes:
    """How large a program's tensors are drawn: each size from `dims`, no value larger than
    `max_elements`; `fitted`: an input's sizes drawn within that bound too (at model sizes, where
    four drawn sizes would overshoot it by far), and only `steps` drawn, those whose numbers
    depend on the sizes (sums over long rows, normalizations, attention, matrix products), not
    those that write positions out in the source (masks, index lists)."""

    dims: tuple[int, ...]
    max_elements: int
    fitted: bool = False
    max_weight_elements: int = 0  # a conv's weights (0: no bound)


SMALL = Sizes((2, 3, 1, 4, 5, 8), 512)
# A 1B language model's widths and sequence lengths: hidden 2048, 512 tokens.
MODEL_TOKENS = (1, 8, 64, 256, 512)
MODEL_WIDTHS = (64, 256, 512, 1024, 2048)
MODEL = Sizes((1, 2, 3, 8, 64, 256, 512, 1024, 2048), 512 * 2048, fitted=True, max_weight_elements=2048 * 2048)
_INT_RANGE = {torch.uint8: (0, 255), torch.int8: (-128, 127), torch.int32: (-(2**31), 2**31 - 1)}


@attrs.frozen
class Value:
    """A tensor the program computes: the expression naming it, its shape, dtype and noise."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    noise: float = 0.0
    # Its size depends on the data (a computed boolean mask picked it): only an output.
    data_dependent: bool = False

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def exact_enough(self) -> bool:
        return self.noise <= EXACT_ENOUGH


@attrs.frozen
class Attribute:
    """A parameter, buffer or plain tensor attribute of the module, and how it is made."""

    kind: str  # "parameter", "buffer" or "tensor"
    name: str
    init: str


@attrs.frozen
class Quantization:
    """The scheme a program is quantized by before both paths compile it (the quantize axis)."""

    scheme: str
    granularity: str
    group_size: int
    embedding: str | None = None
    embedding_group_size: int = 0  # 0: one scale per embedding row
    calibration_draws: int = 0  # inputs drawn again to calibrate a static scheme

    def options(self) -> dict:
        """The quantize options `compiler.compile` takes."""
        options = {
            "quantize": self.scheme, "quantize_granularity": self.granularity, "quantize_group_size": self.group_size,
        }
        if self.embedding:
            options.update(quantize_embedding=self.embedding, quantize_embedding_group_size=self.embedding_group_size)
        return options


@attrs.frozen
class Program:
    inputs: tuple[str, ...]  # how each forward input is made
    attributes: tuple[Attribute, ...]
    lines: tuple[str, ...]
    outputs: tuple[Value, ...]
    # Forward calls a check makes: 2 when a buffer is written, so its state must carry.
    calls: int = 1
    quantization: Quantization | None = None

    def source(self) -> str:
        init = []
        for a in self.attributes:
            if a.kind == "parameter":
                init.append(f"self.{a.name} = torch.nn.Parameter({a.init}, requires_grad=False)")
            elif a.kind == "buffer":
                init.append(f"self.register_buffer({a.name!r}, {a.init})")
            else:
                init.append(f"self.{a.name} = {a.init}")
        args = ", ".join(f"x{i}" for i in range(len(self.inputs)))
        returned = ", ".join(v.name for v in self.outputs)
        body = "\n".join(f"        {line}" for line in (*self.lines, f"return ({returned},)"))
        drawn = f"({''.join(f'{x}, ' for x in self.inputs)})"
        draws = self.quantization.calibration_draws if self.quantization else 0
        return (
            "import torch\nimport torch.nn.functional as F\n\n\n"
            "class Program(torch.nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n"
            + "".join(f"        {line}\n" for line in init)
            + f"\n    def forward(self, {args}):\n{body}\n\n\n"
            "def make():\n    torch.manual_seed(0)\n    model = Program().eval()\n"
            f"    inputs = {drawn}\n"
            "    return model, inputs\n"
            + (f"\n\ndef calibration():\n    torch.manual_seed(1)\n    return [{drawn} for _ in range({draws})]\n"
               if draws else "")
        )

    def _namespace(self) -> dict:
        namespace: dict = {}
        exec(compile(self.source(), "<program>", "exec"), namespace)
        return namespace

    def build(self) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        return self._namespace()["make"]()

    def calibration(self) -> list[tuple[torch.Tensor, ...]]:
        """The inputs drawn again for a static scheme's calibration (none for other programs)."""
        return self._namespace()["calibration"]() if self.quantization and self.quantization.calibration_draws else []

    @property
    def tolerances(self) -> tuple[float, ...]:
        return tuple(tolerance(v) for v in self.outputs)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.outputs)


@attrs.frozen
class Reproducer:
    """A program read back from a repro file: what the oracle needs, without the generator."""

    build: Callable[[], tuple[torch.nn.Module, tuple]]
    calls: int
    tolerances: tuple[float, ...]
    names: tuple[str, ...]
    backend: str  # the backend it was found on
    quantization: Quantization | None = None
    calibration: Callable[[], list] = list

    @classmethod
    def load(cls, path: str) -> "Reproducer":
        namespace: dict = {"__name__": "reproducer"}
        with open(path) as f:
            exec(compile(f.read(), path, "exec"), namespace)
        quantization = namespace.get("QUANTIZATION")
        return cls(
            namespace["make"], namespace["CALLS"], tuple(namespace["TOLERANCES"]), tuple(namespace["OUTPUTS"]),
            namespace["BACKEND"], Quantization(**quantization) if quantization else None,
            namespace.get("calibration", list),
        )


def tolerance(value: Value) -> float:
    """The normwise error an output may show: |got - want| <= tol * max(1, max|want|)."""
    if not value.is_float:
        return 0.0
    resolution = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(value.dtype, 0.0)
    return max(8 * value.noise, 2 * resolution)


class _Builder:
    """Draws one program step by step, running each line as it goes."""

    def __init__(self, draw: Callable, quantization: Quantization | None = None, sizes: Sizes = SMALL) -> None:
        self.draw = draw
        self.quantization = quantization
        self.sizes = sizes
        self.layers: dict[str, Value] = {}  # step name -> the last output of a layer a scheme quantizes
        self.values: list[Value] = []
        self.inputs: list[str] = []
        self.attributes: list[Attribute] = []
        self.lines: list[str] = []
        self.calls = 1
        self.module = types.SimpleNamespace()
        self.namespace: dict = {"torch": torch, "F": torch.nn.functional, "self": self.module}
        self._counter = 0

    # -- drawing helpers ------------------------------------------------------------
    def choice(self, options):
        return self.draw(st.sampled_from(list(options)))

    def integer(self, low: int, high: int) -> int:
        return self.draw(st.integers(low, high))

    def coin(self) -> bool:
        return self.draw(st.booleans())

    def shape(self, min_rank: int = 1, max_rank: int = 4) -> tuple[int, ...]:
        rank = self.integer(min_rank, max_rank)
        if not self.sizes.fitted:
            return tuple(self.choice(self.sizes.dims) for _ in range(rank))
        budget, drawn = self.sizes.max_elements, []
        for _ in range(rank):
            drawn.append(self.choice([d for d in self.sizes.dims if d <= budget]))
            budget //= drawn[-1]
        return tuple(drawn)

    def pick(self, accept: Callable[[Value], bool] = lambda v: True, *, data_dependent: bool = False):
        candidates = [v for v in self.values if accept(v) and (data_dependent or not v.data_dependent)]
        return self.choice(candidates) if candidates else None

    def fresh(self, prefix: str = "v") -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    # -- making things --------------------------------------------------------------
    def attribute(self, kind: str, init: str, prefix: str = "c") -> str:
        name = self.fresh(prefix)
        torch.manual_seed(len(self.attributes))
        setattr(self.module, name, eval(init, self.namespace))
        self.attributes.append(Attribute(kind, name, init))
        return f"self.{name}"

    def random_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> str:
        dims = f"({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})"
        if dtype.is_floating_point:
            return f"torch.randn({dims}, dtype={dtype})"
        if dtype == torch.bool:
            return f"torch.rand({dims}) > 0.5"
        low, high = (0, 256) if dtype == torch.uint8 else (-8, 8)
        return f"torch.randint({low}, {high}, {dims}, dtype={dtype})"

    def constant(self, shape: tuple[int, ...], dtype: torch.dtype) -> str:
        """A new constant: a parameter (floats), a buffer or a plain tensor attribute."""
        kind = self.choice(("parameter", "buffer", "tensor")) if dtype.is_floating_point else self.choice(("buffer", "tensor"))
        return self.attribute(kind, self.random_tensor(shape, dtype), "p" if kind == "parameter" else "c")

    def literal(self, values, dtype: torch.dtype = torch.int64) -> str:
        """A small tensor written out in the source: a lifted constant when in forward."""
        return f"torch.tensor({values!r}, dtype={dtype})"

    def emit(self, lines: list[str], result: str | list[str], noise: float = 0.0, data_dependent: bool = False) -> bool:
        """Run `lines`; the names in `result` become values. False (and nothing kept) if one is too big."""
        with torch.no_grad():
            for line in lines:
                exec(line, self.namespace)
        names = [result] if isinstance(result, str) else result
        tensors = [self.namespace[n] for n in names]
        if any(not 0 < t.numel() <= self.sizes.max_elements for t in tensors) and not data_dependent:
            return False
        if self.quantization and any(t.is_floating_point() for t in tensors):
            noise = max(noise, QUANTIZED_NOISE)
        self.lines.extend(lines)
        for name, t in zip(names, tensors):
            self.values.append(Value(name, tuple(t.shape), t.dtype, noise, data_dependent))
        return True

    def assign(self, expression: str, noise: float = 0.0, data_dependent: bool = False) -> bool:
        name = self.fresh()
        return self.emit([f"{name} = {expression}"], name, noise, data_dependent)

    def layer(self, step: Callable, expression: str) -> bool:
        """`assign`, and remember the value as `step`'s latest quantized layer output."""
        if not self.assign(expression):
            return False
        self.layers[step.__name__] = self.values[-1]
        return True

    def program(self, outputs: list[Value]) -> Program:
        return Program(
            tuple(self.inputs), tuple(self.attributes), tuple(self.lines), tuple(outputs), self.calls, self.quantization
        )


def _noise(*values: Value, dtype: torch.dtype | None = None, ops: int = 1) -> float:
    """The noise of a float result computed from `values` by `ops` roundings in `dtype`."""
    dtype = dtype or next((v.dtype for v in values if v.is_float), torch.float32)
    return max((v.noise for v in values), default=0.0) + ops * OP_NOISE.get(dtype, 0.0)


def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape these broadcast to, or None when they do not."""
    try:
        return tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        return None


def _dims(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''})"


def _fill_value(b: _Builder, dtype: torch.dtype):
    if dtype == torch.bool:
        return b.coin()
    if dtype.is_floating_point:
        return b.choice((0.5, -2.25, 0.0, 3.0, 2049.0, -1e4))
    low, high = _INT_RANGE.get(dtype, (-(2**63), 2**63 - 1))
    return b.choice([v for v in (1, 0, -1, 7, 200, -100, 2049, 3001, 70001) if low <= v <= high])


def _broadcast_partner(b: _Builder, x: Value, accept: Callable[[Value], bool]) -> tuple[str, Value | None]:
    """Something to combine with `x`: a value that broadcasts with it, a new constant, or a number."""
    kind = b.choice(("value", "scalar", "constant"))
    if kind == "value":
        y = b.pick(lambda v: accept(v) and math.prod(_broadcast(x.shape, v.shape) or (b.sizes.max_elements + 1,))
                   <= b.sizes.max_elements)
        if y is not None:
            return y.name, y
    if kind == "constant" and x.rank:
        shape = tuple(1 if b.coin() else d for d in x.shape)[b.integer(0, x.rank - 1):]
        dtype = x.dtype if x.dtype != torch.bool else torch.bool
        name = b.constant(shape, dtype)
        return name, Value(name, shape, dtype)
    return repr(_fill_value(b, x.dtype if x.dtype != torch.bool else torch.int64)), None


# -- the catalogue: each step draws its operands and emits a line, or returns False ---
_FLOAT_UNARY = (
    ("torch.relu({})", False), ("torch.sigmoid({})", False), ("torch.tanh({})", False), ("-{}", False),
    ("{}.abs()", False), ("torch.sin({})", False), ("torch.exp({}.clamp(max=4))", False),
    ("F.gelu({})", False), ("F.gelu({}, approximate='tanh')", False), ("F.silu({})", False),
    ("torch.sqrt({}.abs())", False), ("torch.rsqrt({}.abs() + 1)", False), ("torch.log1p({}.abs())", False),
    ("torch.erf({})", False), ("{}.clamp(-0.5, 0.5)", False), ("F.hardtanh({})", False),
    ("F.leaky_relu({}, 0.1)", False), ("torch.reciprocal({}.abs() + 1)", False), ("{} ** 2", False),
    ("F.softplus({})", False), ("F.hardswish({})", False), ("F.elu({})", False),
    ("{}.floor()", True), ("{}.round()", True), ("torch.sign({})", True),
)
_INT_UNARY = ("-{}", "{}.abs()", "{}.clamp(1, 5)", "{} * 3", "torch.bitwise_not({})", "torch.sign({})")


def unary(b: _Builder) -> bool:
    x = b.pick(lambda v: True, data_dependent=True)
    if x is None:
        return False
    if x.dtype == torch.bool:
        return b.assign(b.choice(("~{}", "torch.logical_not({})")).format(x.name), data_dependent=x.data_dependent)
    if not x.is_float:
        form = b.choice(_INT_UNARY)
        if x.dtype == torch.uint8 and form in ("-{}", "{}.abs()", "torch.sign({})"):
            form = "{} * 3"
        return b.assign(form.format(x.name), data_dependent=x.data_dependent)
    form, jumps = b.choice(_FLOAT_UNARY)
    if jumps and not x.exact_enough:
        form = "torch.relu({})"
    return b.assign(form.format(x.name), _noise(x, ops=4), data_dependent=x.data_dependent)


def binary(b: _Builder) -> bool:
    x = b.pick()
    if x is None:
        return False
    if x.dtype == torch.bool:
        y, yv = _broadcast_partner(b, x, lambda v: v.dtype == torch.bool)
        if yv is None:
            y = "True" if b.coin() else "False"
        return b.assign(f"{x.name} {b.choice(('&', '|', '^'))} {y}")
    y, yv = _broadcast_partner(b, x, lambda v: v.dtype != torch.bool)
    floats = x.is_float or (yv is not None and yv.is_float) or "." in y
    forms = ["{x} + {y}", "{x} - {y}", "{x} * {y}", "torch.maximum({x}, torch.as_tensor({y}))",
             "torch.minimum({x}, torch.as_tensor({y}))"]
    if floats:
        forms.append("{x} / (torch.as_tensor({y}).abs() + 1)")
    else:
        forms += ["torch.remainder({x}, 3)", "{x} % -3", "{x} // 3", "torch.fmod({x}, 3)"]
    if not floats and yv is not None:
        forms += ["torch.div({x}, {y}.clamp(min=1), rounding_mode='floor')",
                  "torch.div({x}, {y}.clamp(min=1), rounding_mode='trunc')",
                  "torch.remainder({x}, {y}.clamp(min=1))", "{x} & {y}", "{x} | {y}"]
    form = b.choice(forms)
    operands = (x,) + ((yv,) if yv is not None else ())
    return b.assign(form.format(x=x.name, y=y), _noise(*operands))


def cast(b: _Builder) -> bool:
    x = b.pick()
    if x is None:
        return False
    target = b.choice(DTYPES)
    if x.is_float and not target.is_floating_point and target != torch.bool:
        if not x.exact_enough:
            return False
        low, high = _INT_RANGE.get(target, (-1000, 1000))
        low, high = max(low, -1000), min(high, 1000)
        return b.assign(f"{x.name}.clamp({low}, {high}).to({target})")
    form = b.choice(("{x}.to({d})", "{x}.to(dtype={d})", "{x}.type({d})"))
    if target == torch.float32:
        form = b.choice((form, "{x}.float()"))
    if target == torch.float16:
        form = b.choice((form, "{x}.half()"))
    noise = x.noise if target.is_floating_point else 0.0
    return b.assign(form.format(x=x.name, d=target), noise)


def _factorizations(n: int, rank: int) -> list[tuple[int, ...]]:
    if rank == 1:
        return [(n,)]
    return [(d,) + rest for d in range(1, n + 1) if n % d == 0 for rest in _factorizations(n // d, rank - 1)]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _factorization(b: _Builder, n: int, rank: int) -> tuple[int, ...]:
    """One way to write `n` as a product of `rank` sizes: all of them listed for small sizes, one
    drawn divisor by divisor at model sizes (a million has too many to list)."""
    if not b.sizes.fitted:
        return b.choice(_factorizations(n, rank))
    drawn = []
    for _ in range(rank - 1):
        drawn.append(b.choice(_divisors(n)))
        n //= drawn[-1]
    return tuple(drawn) + (n,)


def view(b: _Builder) -> bool:
    x = b.pick(lambda v: v.numel > 0)
    if x is None:
        return False
    t = b.namespace[x.name]
    kinds = ["reshape", "unsqueeze", "flatten"]
    if x.rank >= 2:
        kinds += ["permute", "transpose", "mT", "unflatten"]
    if 1 in x.shape:
        kinds += ["squeeze", "expand"]
    kind = b.choice(kinds)
    if kind == "reshape":
        shape = _factorization(b, x.numel, b.integer(1, 4))
        method = "view" if t.is_contiguous() and b.coin() else "reshape"
        if b.coin() and len(shape) > 1:
            shape = (-1,) + shape[1:]
        return b.assign(f"{x.name}.{method}{_dims(shape)}")
    if kind == "unsqueeze":
        return b.assign(f"{x.name}.unsqueeze({b.integer(-x.rank - 1, x.rank)})")
    if kind == "flatten":
        return b.assign(f"{x.name}.flatten({b.integer(0, max(x.rank - 1, 0))})" if x.rank else f"{x.name}.flatten()")
    if kind == "permute":
        order = b.draw(st.permutations(range(x.rank)))
        return b.assign(f"{x.name}.permute{_dims(tuple(order))}")
    if kind == "transpose":
        return b.assign(f"{x.name}.transpose({b.integer(0, x.rank - 1)}, {b.integer(-x.rank, -1)})")
    if kind == "mT":
        return b.assign(f"{x.name}.mT")
    if kind == "unflatten":
        dim = b.integer(0, x.rank - 1)
        return b.assign(f"{x.name}.unflatten({dim}, {_factorization(b, x.shape[dim], 2)})")
    ones = [i for i, d in enumerate(x.shape) if d == 1]
    if kind == "squeeze":
        return b.assign(f"{x.name}.squeeze({b.choice(ones)})")
    sizes = tuple(b.choice((2, 3, 4)) if i in ones and b.coin() else (-1 if b.coin() else d) for i, d in enumerate(x.shape))
    return b.assign(f"{x.name}.expand{_dims(sizes)}")


def _along_a_long_dim(step: Callable[[_Builder, Value, int], bool]) -> Callable[[_Builder], bool]:
    """A step that cuts a value along one of its dims of size 2 or more (slicing, splitting):
    it is given the value and the dim, and adds nothing when no value has such a dim."""

    @functools.wraps(step)
    def cut(b: _Builder) -> bool:
        x = b.pick(lambda v: any(d >= 2 for d in v.shape))
        if x is None:
            return False
        return step(b, x, b.choice([i for i, d in enumerate(x.shape) if d >= 2]))

    return cut


@_along_a_long_dim
def slicing(b: _Builder, x: Value, dim: int) -> bool:
    size = x.shape[dim]
    prefix = ":, " * dim
    kind = b.choice(("slice", "narrow", "select", "negative", "step"))
    if kind == "slice":
        start = b.integer(0, size - 1)
        return b.assign(f"{x.name}[{prefix}{start}:{b.integer(start + 1, size)}]")
    if kind == "narrow":
        start = b.integer(0, size - 1)
        return b.assign(f"{x.name}.narrow({dim}, {start}, {b.integer(1, size - start)})")
    if kind == "select":
        return b.assign(f"{x.name}.select({dim}, {b.integer(-size, size - 1)})")
    if kind == "negative":
        return b.assign(f"{x.name}[{prefix}-{b.integer(1, size)}:]")
    return b.assign(f"{x.name}[{prefix}{b.integer(0, 1)}::{b.integer(2, 3)}]")


def join(b: _Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1 and 0 < v.numel <= b.sizes.max_elements // 2)
    if x is None:
        return False
    dim = b.integer(-x.rank, x.rank - 1)
    along = dim % x.rank
    partners = [v for v in b.values if v.rank == x.rank and not v.data_dependent
                and all(a == c for i, (a, c) in enumerate(zip(v.shape, x.shape)) if i != along)]
    y = b.choice(partners)
    if y.numel + x.numel > b.sizes.max_elements:
        y = x
    noise = max(x.noise, y.noise)
    if y.shape == x.shape and b.coin():
        return b.assign(f"torch.stack([{x.name}, {y.name}], {b.integer(0, x.rank)})", noise)
    return b.assign(f"torch.cat([{x.name}, {y.name}], {dim})", noise)


@_along_a_long_dim
def split(b: _Builder, x: Value, dim: int) -> bool:
    size = x.shape[dim]
    kind = b.choice(("split", "sizes", "unbind", "chunk"))
    if kind == "split":
        part = b.integer(1, size - 1)
        count, call = -(-size // part), f"{x.name}.split({part}, {dim})"
    elif kind == "sizes":
        first = b.integer(1, size - 1)
        count, call = 2, f"torch.split({x.name}, [{first}, {size - first}], {dim})"
    elif kind == "unbind":
        count, call = size, f"{x.name}.unbind({dim})"
    else:
        chunks = b.integer(2, size)
        count, call = len(torch.empty(x.shape).chunk(chunks, dim)), f"{x.name}.chunk({chunks}, {dim})"
    names = [b.fresh() for _ in range(count)]
    return b.emit([f"{', '.join(names)}, = {call}"], names, x.noise)


def reduce(b: _Builder) -> bool:
    x = b.pick(lambda v: v.numel > 0)
    if x is None:
        return False
    dims = sorted(set(b.draw(st.lists(st.integers(0, x.rank - 1), min_size=1, max_size=x.rank)))) if x.rank else []
    keep = b.coin()
    reduced = math.prod(x.shape[d] for d in dims) if dims else x.numel
    over = f"{dims}, keepdim={keep}" if dims else ""
    one = f"{dims[0]}, keepdim={keep}" if dims else ""
    if x.dtype == torch.bool:
        return b.assign(b.choice((f"{x.name}.any({one})", f"{x.name}.all({one})", f"{x.name}.sum({over})")))
    if not x.is_float:
        forms = [f"{x.name}.sum({over})", f"{x.name}.amax({over})", f"{x.name}.amin({over})"]
        if dims:
            forms += [f"{x.name}.argmax({one})", f"{x.name}.cumsum({dims[0]})"]
        return b.assign(b.choice(forms))
    forms = [f"{x.name}.sum({over})", f"{x.name}.mean({over})", f"{x.name}.amax({over})", f"{x.name}.amin({over})"]
    if dims:
        forms += [f"{x.name}.var({over})"] if reduced > 1 else []
        forms += [f"torch.logsumexp({x.name}, {dims})", f"{x.name}.cumsum({dims[0]})",
                  f"torch.linalg.vector_norm({x.name}, dim={dims})"]
        if x.exact_enough:
            forms += [f"{x.name}.argmax({one})", f"{x.name}.argmin({one})"]
    return b.assign(b.choice(forms), _noise(x, ops=2 * reduced))


def compare(b: _Builder) -> bool:
    x = b.pick(lambda v: v.dtype != torch.bool and v.exact_enough)
    if x is None:
        return False
    y, _ = _broadcast_partner(b, x, lambda v: v.dtype != torch.bool and v.exact_enough)
    return b.assign(f"{x.name} {b.choice(('>', '<', '>=', '<=', '==', '!='))} {y}")


def select_where(b: _Builder) -> bool:
    mask = b.pick(lambda v: v.dtype == torch.bool)
    if mask is None:
        return False
    def broadcasts(v: Value) -> bool:
        shape = _broadcast(mask.shape, v.shape)
        return shape is not None and math.prod(shape) <= b.sizes.max_elements and v.dtype != torch.bool

    x = b.pick(broadcasts)
    if x is None:
        return False
    if b.coin():
        fill = _fill_value(b, x.dtype)
        if x.is_float and b.integer(0, 9) == 0:
            fill = "float('-inf')"
        if _broadcast(mask.shape, x.shape) == x.shape:
            return b.assign(f"{x.name}.masked_fill({mask.name}, {fill})", x.noise)
    y, yv = _broadcast_partner(b, x, lambda v: v.dtype == x.dtype and broadcasts(v))
    return b.assign(f"torch.where({mask.name}, {x.name}, {y})", max(x.noise, yv.noise if yv else 0.0))


def fill(b: _Builder) -> bool:
    dtype = b.choice(DTYPES)
    value = _fill_value(b, dtype)
    shape = _dims(b.shape(0, 3))
    x = b.pick()
    forms = [f"torch.full({shape}, {value!r})", f"torch.full({shape}, {value!r}, dtype={dtype})",
             f"torch.zeros({shape}, dtype={dtype})", f"torch.ones({shape})",
             f"torch.scalar_tensor({value!r})", f"torch.scalar_tensor({value!r}, dtype={dtype})",
             f"torch.arange({b.integer(1, 8)}, dtype={dtype if dtype not in (torch.bool,) else torch.int64})"]
    if x is not None:
        forms += [f"torch.ones_like({x.name})", f"torch.zeros_like({x.name}, dtype={dtype})",
                  f"torch.full_like({x.name}, {_fill_value(b, x.dtype)!r})",
                  f"torch.full_like({x.name}, {value!r}, dtype={dtype})",
                  f"{x.name}.new_full({shape}, {_fill_value(b, x.dtype)!r})",
                  f"{x.name}.new_zeros({shape})", f"{x.name}.new_ones({shape}, dtype={dtype})"]
    form = b.choice(forms)
    if "scalar_tensor" in form and dtype == torch.bool and "dtype" not in form:
        form = f"torch.scalar_tensor({int(value)})"
    return b.assign(form)


def linear(b: _Builder) -> bool:
    x = b.pick(lambda v: v.is_float and v.rank >= 1 and v.shape[-1] > 0)
    if x is None:
        return False
    k, n = x.shape[-1], b.choice(b.sizes.dims)
    kind = b.choice(("parameter", "slice", "transposed", "shared", "matmul"))
    noise = _noise(x, ops=2 * k)
    if kind == "matmul":
        y = b.pick(lambda v: v.dtype == x.dtype and v.rank >= 2 and v.shape[-2] == k and v.rank <= max(x.rank, 2))
        if y is not None and _broadcast(x.shape[:-2], y.shape[:-2]) is not None:
            return b.assign(f"torch.matmul({x.name}, {y.name})", _noise(x, y, ops=2 * k))
        kind = "parameter"
    if kind == "shared":
        w = next((a for a in b.attributes if a.kind == "parameter" and tuple(getattr(b.module, a.name).shape) == (n, k)
                  and getattr(b.module, a.name).dtype == x.dtype), None)
        if w is not None:
            return b.assign(f"F.linear({x.name}, self.{w.name})", noise)
        kind = "parameter"
    if kind == "slice":
        start, extra = b.integer(1, 4), b.integer(0, 3)
        w = b.attribute("parameter", f"torch.randn({start + n + extra}, {k}, dtype={x.dtype})", "p")
        return b.assign(f"F.linear({x.name}, {w}[{start}:{start + n}])", noise)
    if kind == "transposed":
        w = b.attribute("parameter", f"torch.randn({k}, {n}, dtype={x.dtype})", "p")
        return b.assign(b.choice((f"{x.name} @ {w}", f"F.linear({x.name}, {w}.t())")), noise)
    w = b.attribute("parameter", f"torch.randn({n}, {k}, dtype={x.dtype})", "p")
    bias = f", {b.attribute('parameter', f'torch.randn({n}, dtype={x.dtype})', 'p')}" if b.coin() else ""
    return b.assign(f"F.linear({x.name}, {w}{bias})", noise)


def conv(b: _Builder) -> bool:
    x = b.pick(lambda v: v.dtype in (torch.float32, torch.bfloat16) and v.rank in (3, 4) and v.shape[1] > 0)
    if x is None:
        return False
    spatial = x.shape[2:]
    channels = x.shape[1]
    kernel = b.integer(1, min(3, min(spatial) + 2))
    padding = b.integer(0 if kernel <= min(spatial) else 1, 1)
    if kernel > min(spatial) + 2 * padding:
        kernel = 1
    stride = b.integer(1, 2)
    depthwise = b.coin()
    out = channels * b.integer(1, 2) if depthwise else b.choice(b.sizes.dims)
    groups = channels if depthwise else 1
    conv_fn = "F.conv2d" if x.rank == 4 else "F.conv1d"
    shape = (out, channels // groups) + (kernel,) * len(spatial)
    if b.sizes.max_weight_elements and math.prod(shape) > b.sizes.max_weight_elements:
        return False
    w = b.attribute("parameter", f"torch.randn({_dims(shape)}, dtype={x.dtype})", "p")
    bias = b.attribute("parameter", f"torch.randn({out}, dtype={x.dtype})", "p") if b.coin() else "None"
    name = b.fresh()
    lines = [f"{name} = {conv_fn}({x.name}, {w}, {bias}, stride={stride}, padding={padding}, groups={groups})"]
    fanin = channels // groups * kernel ** len(spatial)
    if b.coin():
        mean = b.attribute("buffer", f"torch.randn({out}, dtype={x.dtype})")
        var = b.attribute("buffer", f"torch.rand({out}, dtype={x.dtype}) + 0.5")
        gamma = b.attribute("parameter", f"torch.randn({out}, dtype={x.dtype})", "p")
        beta = b.attribute("parameter", f"torch.randn({out}, dtype={x.dtype})", "p")
        lines.append(f"{name} = F.batch_norm({name}, {mean}, {var}, {gamma}, {beta}, False, 0.1, 1e-5)")
    return b.emit(lines, name, _noise(x, ops=2 * fanin + 4))


def norm(b: _Builder) -> bool:
    x = b.pick(lambda v: v.is_float and v.rank >= 1 and v.shape[-1] > 1)
    if x is None:
        return False
    n = x.shape[-1]
    affine = b.coin()
    weight = b.attribute("parameter", f"torch.randn({n}, dtype={x.dtype})", "p") if affine else "None"
    kind = b.choice(("layer", "rms", "batch", "normalize"))
    noise = _noise(x, ops=4 * n)
    if kind == "layer":
        bias = b.attribute("parameter", f"torch.randn({n}, dtype={x.dtype})", "p") if affine and b.coin() else "None"
        return b.assign(f"F.layer_norm({x.name}, ({n},), {weight}, {bias}, eps={b.choice((1e-5, 1e-3))})", noise)
    if kind == "rms":
        return b.assign(f"F.rms_norm({x.name}, ({n},), {weight}, eps={b.choice((None, 1e-6))})", noise)
    if kind == "batch" and x.rank >= 2:
        c = x.shape[1]
        mean = b.attribute("buffer", f"torch.randn({c}, dtype={x.dtype})")
        var = b.attribute("buffer", f"torch.rand({c}, dtype={x.dtype}) + 0.5")
        return b.assign(f"F.batch_norm({x.name}, {mean}, {var}, None, None, False, 0.1, 1e-5)", noise)
    return b.assign(f"F.normalize({x.name}, dim=-1)", noise)


def attention(b: _Builder) -> bool:
    x = b.pick(lambda v: v.is_float and v.rank >= 1 and v.numel > 0)
    if x is None:
        return False
    if x.rank < 3 or b.coin():
        dim = b.integer(-x.rank, x.rank - 1)
        form = b.choice(("torch.softmax({}, {})", "F.log_softmax({}, {})", "F.softmax({}, dim={})"))
        return b.assign(form.format(x.name, dim), _noise(x, ops=4 * x.shape[dim]))
    length, width = x.shape[-2], x.shape[-1]
    same = [v for v in b.values if v.shape == x.shape and v.dtype == x.dtype and not v.data_dependent]
    k, v = b.choice(same), b.choice(same)
    # A boolean mask is written out in the source, one element at a time: not at model sizes.
    mask = b.choice(("none", "causal", "float") if b.sizes.fitted else ("none", "causal", "bool", "float"))
    extra = ""
    if mask == "causal":
        extra = ", is_causal=True"
    elif mask == "bool":
        rows = [[j == i or b.coin() for j in range(length)] for i in range(length)]
        extra = f", attn_mask={b.attribute('tensor', b.literal(rows, torch.bool))}"
    elif mask == "float":
        extra = f", attn_mask={b.attribute('buffer', f'torch.randn({length}, {length}, dtype={x.dtype})')}"
    noise = _noise(x, k, v, ops=8 * (length + width))
    return b.assign(f"F.scaled_dot_product_attention({x.name}, {k.name}, {v.name}{extra})", noise)


def _positions(b: _Builder, size: int, count: int, unique: bool, negative: bool = True) -> list[int]:
    low = -size if negative else 0
    if unique:
        chosen = b.draw(st.lists(st.integers(0, size - 1), min_size=1, max_size=min(count, size), unique=True))
        return [p - size if negative and b.coin() else p for p in chosen]
    return b.draw(st.lists(st.integers(low, size - 1), min_size=1, max_size=count))


def _index_tensor(b: _Builder, positions: list[int]) -> str:
    """Index positions as a constant attribute or as a tensor made in forward (a lifted constant)."""
    literal = b.literal(positions)
    return b.attribute(b.choice(("tensor", "buffer")), literal) if b.coin() else literal


def _mask(b: _Builder, shape: tuple[int, ...]) -> str:
    bits = torch.rand(shape) > 0.5
    if bits.numel():
        bits.view(-1)[b.integer(0, bits.numel() - 1)] = True
    return b.attribute(b.choice(("tensor", "buffer")), b.literal(bits.tolist(), torch.bool))


def index(b: _Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1 and v.numel > 0)
    if x is None:
        return False
    dim = b.integer(0, x.rank - 1)
    size = x.shape[dim]
    prefix = ":, " * dim
    kind = b.choice(("positions", "index_select", "gather", "computed", "mask", "computed_mask"))
    if kind == "positions":
        return b.assign(f"{x.name}[{prefix}{_index_tensor(b, _positions(b, size, 4, unique=False))}]", x.noise)
    if kind == "index_select":
        idx = _index_tensor(b, _positions(b, size, 4, unique=False, negative=False))
        return b.assign(f"{x.name}.index_select({dim}, {idx})", x.noise)
    if kind == "gather":
        shape = x.shape[:dim] + (b.integer(1, 3),) + x.shape[dim + 1 :]
        positions = torch.randint(0, size, shape).tolist()
        return b.assign(f"torch.gather({x.name}, {dim}, {b.attribute('buffer', b.literal(positions))})", x.noise)
    if kind == "computed":
        i = b.pick(lambda v: v.dtype in INTEGERS and v.rank <= 2 and v.numel <= 8)
        if i is not None:
            return b.assign(f"{x.name}[{prefix}{i.name}.long().clamp(0, {size - 1})]", x.noise)
    lead = b.integer(1, x.rank)
    if kind == "computed_mask":
        m = b.pick(lambda v: v.dtype == torch.bool and v.shape == x.shape[:lead])
        if m is not None:
            return b.assign(f"{x.name}[{m.name}]", x.noise, data_dependent=True)
    return b.assign(f"{x.name}[{_mask(b, x.shape[:lead])}]", x.noise, data_dependent=True)


def index_put(b: _Builder) -> bool:
    x = b.pick(lambda v: v.rank >= 1 and v.numel > 0)
    if x is None:
        return False
    y = b.fresh()
    lines = [f"{y} = {x.name}.clone()"]
    dim = b.integer(0, min(1, x.rank - 1))
    size = x.shape[dim]
    prefix = ":, " * dim
    rest = x.shape[dim + 1 :]
    kind = b.choice(("positions", "accumulate", "functional", "two", "mask", "computed_mask", "slice", "masked_fill_"))
    source_noise = 0.0

    def values(count: int, tensor: bool = False) -> str:
        nonlocal source_noise
        shape = x.shape[:dim] + (count,) + rest
        v = b.pick(lambda v: v.shape == shape) if b.coin() else None
        if v is None:
            if b.coin():
                number = repr(_fill_value(b, x.dtype))
                return f"torch.tensor({number}, dtype={x.dtype})" if tensor else number
            return b.constant(shape, x.dtype)
        source_noise = v.noise
        return f"{v.name}.to({x.dtype})"

    if kind == "positions":
        positions = _positions(b, size, 4, unique=True)
        lines.append(f"{y}[{prefix}{_index_tensor(b, positions)}] = {values(len(positions))}")
    elif kind in ("accumulate", "functional"):
        dim, prefix, rest = 0, "", x.shape[1:]
        positions = _positions(b, x.shape[0], 4, unique=kind == "functional")
        vals = values(len(positions), tensor=True)
        where = f"({_index_tensor(b, positions)},)"
        if kind == "accumulate":
            lines.append(f"{y}.index_put_({where}, {vals}, accumulate=True)")
        else:
            lines = [f"{y} = torch.index_put({x.name}, {where}, {vals})"]
    elif kind == "two" and x.rank >= 2:
        positions = _positions(b, x.shape[0] * x.shape[1], 4, unique=True, negative=False)
        rows = _index_tensor(b, [p // x.shape[1] for p in positions])
        cols = _index_tensor(b, [p % x.shape[1] for p in positions])
        lines.append(f"{y}[{rows}, {cols}] = {repr(_fill_value(b, x.dtype))}")
    elif kind in ("mask", "computed_mask", "two"):
        lead = b.integer(1, x.rank)
        m = b.pick(lambda v: v.dtype == torch.bool and v.shape == x.shape[:lead]) if kind == "computed_mask" else None
        if m is not None:
            lines.append(f"{y}[{m.name}] = {repr(_fill_value(b, x.dtype))}")
        else:
            mask = _mask(b, x.shape[:lead])
            count = int(getattr(b.module, mask.split(".")[1]).sum())
            shape = (count,) + x.shape[lead:]
            lines.append(f"{y}[{mask}] = {b.constant(shape, x.dtype) if b.coin() else repr(_fill_value(b, x.dtype))}")
    elif kind == "slice" and size >= 2:
        start = b.integer(0, size - 2)
        lines.append(f"{y}[{prefix}{start}:{start + 2}] = {values(2)}")
    else:
        m = b.pick(lambda v: v.dtype == torch.bool and _broadcast(v.shape, x.shape) == x.shape)
        mask = m.name if m is not None else _mask(b, x.shape)
        lines.append(f"{y}.masked_fill_({mask}, {repr(_fill_value(b, x.dtype))})")
    return b.emit(lines, y, max(x.noise, source_noise))


def buffer(b: _Builder) -> bool:
    """A mutable buffer, starting at zero or not, written in place; the state carries between calls."""
    x = b.pick(lambda v: v.dtype != torch.bool)
    if x is None:
        return False
    init = f"torch.zeros({_dims(x.shape)}, dtype={x.dtype})" if b.coin() else b.random_tensor(x.shape, x.dtype)
    state = b.attribute("buffer", init, "s")
    b.calls = 2
    y = b.fresh()
    kind = b.choice(("add", "copy", "accumulate", "positions"))
    if kind == "add":
        lines = [f"{state}.add_({x.name})", f"{y} = {state}"]
    elif kind == "copy":
        lines = [f"{state}.copy_({x.name})", f"{y} = {state} * 2"]
    elif kind == "accumulate" or x.rank == 0:
        lines = [f"{y} = {state} + {x.name}", f"{state}.copy_({y})"]
    else:
        positions = _positions(b, x.shape[0], 3, unique=True)
        idx = _index_tensor(b, positions)
        lines = [f"{state}[{idx}] = {x.name}[{idx}]", f"{y} = {state}[1:]"]
    return b.emit(lines, y, _noise(x, ops=4) if x.is_float else 0.0)


def parameter_value(b: _Builder) -> bool:
    """A value made of parameters alone: folds to a constant."""
    params = [a for a in b.attributes if a.kind == "parameter"]
    if params and b.coin():
        p = b.choice(params)
        t = getattr(b.module, p.name)
        forms = [f"self.{p.name}", f"self.{p.name} * 2 + 1"]
        if t.dim() >= 1 and t.shape[0] >= 2:
            forms.append(f"self.{p.name}[1:]")
        if t.dim() == 2:
            forms.append(f"self.{p.name}.t()")
        return b.assign(b.choice(forms), _noise(Value("", (), t.dtype)))
    dtype, shape = b.choice(FLOATS), b.shape()
    name = b.attribute("parameter", b.random_tensor(shape, dtype), "p")
    forms = [name, f"({name} * 2).exp()"] + ([f"{name}.t()"] if len(shape) == 2 else [])
    forms += [f"{name}[1:]"] if shape[0] >= 2 else []
    return b.assign(b.choice(forms), _noise(Value("", (), dtype)))


def _in_features(b: _Builder, width: int) -> int:
    """`width` padded to a whole number of groups, for a per-group scheme."""
    group = b.quantization.group_size
    return -(-width // group) * group if b.quantization.granularity == schemes.PER_GROUP else width


def quantized_linear(b: _Builder) -> bool:
    """An nn.Linear, the layer every scheme quantizes; its input zero-padded to whole groups."""
    x = b.pick(lambda v: v.dtype == torch.float32 and v.rank >= 1 and v.shape[-1] > 0
               and v.numel // v.shape[-1] * _in_features(b, v.shape[-1]) <= b.sizes.max_elements)
    if x is None:
        return False
    width = _in_features(b, x.shape[-1])
    layer = b.attribute("module", f"torch.nn.Linear({width}, {b.choice(b.sizes.dims + (16, 32))}, bias={b.coin()})", "l")
    padded = x.name if width == x.shape[-1] else f"F.pad({x.name}, (0, {width - x.shape[-1]}))"
    return b.layer(quantized_linear, f"{layer}({padded})")


def quantized_embedding(b: _Builder) -> bool:
    """An nn.Embedding (quantized with the embedding option), looked up by a computed or constant index."""
    rows, group = b.choice((4, 10, 16)), b.quantization.embedding_group_size
    width = group * b.integer(1, 2) if group else b.choice(b.sizes.dims)
    table = b.attribute("module", f"torch.nn.Embedding({rows}, {width})", "e")
    i = b.pick(lambda v: v.dtype in INTEGERS and v.rank <= 2 and v.numel <= 8)
    index = (f"{i.name}.long().clamp(0, {rows - 1})" if i is not None
             else _index_tensor(b, _positions(b, rows, 4, unique=False, negative=False)))
    return b.layer(quantized_embedding, f"{table}({index})")


STEPS = (unary, binary, cast, view, slicing, join, split, reduce, compare, select_where, fill, linear,
         norm, attention, conv, index, index_put, buffer, parameter_value)
# A quantized program is checked by one call of the eager quantized model: no state carried.
QUANTIZED_STEPS = tuple(s for s in STEPS if s is not buffer) + (quantized_linear, quantized_linear)
# At model sizes: the steps whose numbers depend on the sizes, none writing positions out.
SIZED_STEPS = (unary, binary, cast, view, slicing, join, split, reduce, compare, select_where, linear, norm,
               attention, conv)
LAYER_TRIES = 8


@st.composite
def programs(draw, min_steps: int = 2, max_steps: int = 12, quantization: Quantization | None = None,
             sizes: Sizes = SMALL) -> Program:
    """A random program of `min_steps`..`max_steps` steps over 1-3 inputs; with `quantization`,
    its first input float32 and whole groups wide, so an nn.Linear always fits, and at least
    one nn.Linear (and nn.Embedding, for the embedding option) among the steps, the last of
    each an output (no buffer steps)."""
    b = _Builder(draw, quantization, sizes)
    for i in range(b.integer(1, 3)):
        dtype = b.choice((torch.float32,) * 4 + DTYPES[1:])
        shape = b.shape()
        if quantization and i == 0:
            dtype, shape = torch.float32, (b.choice((1, 2, 4)), quantization.group_size * b.integer(1, 2))
        elif sizes.fitted and i == 0:  # a model's activation: (batch, tokens, hidden)
            dtype, shape = b.choice(FLOATS), (b.choice((1, 2)), b.choice(MODEL_TOKENS), b.choice(MODEL_WIDTHS))
        init = b.random_tensor(shape, dtype)
        b.inputs.append(init)
        b.namespace[f"x{i}"] = eval(init, b.namespace)
        b.values.append(Value(f"x{i}", shape, dtype))
    steps = SIZED_STEPS if sizes.fitted else STEPS
    layers: tuple[Callable[[_Builder], bool], ...] = ()
    if quantization:
        layers = (quantized_linear,) + ((quantized_embedding,) if quantization.embedding else ())
        steps = QUANTIZED_STEPS + layers[1:]
    done = 0
    # One "go on?" draw per step (6 in 7: about 8 steps): a shrinker drops a step by
    # dropping its draws, which a step count drawn up front would not let it do.
    while done < max_steps and (done < min_steps or b.integer(0, 6) > 0):
        if b.choice(steps)(b):
            done += 1
    for layer in layers:
        for _ in range(0 if layer.__name__ in b.layers else LAYER_TRIES):
            if layer(b):
                break
    outputs = [b.values[-1]]
    for _ in range(b.integer(0, 2)):
        outputs.append(b.pick(data_dependent=True))
    outputs += [v for v in b.layers.values() if v not in outputs]
    return b.program(outputs)


@st.composite
def quantized_programs(draw, backend: str) -> Program:
    """A random program and a scheme `backend` takes to quantize it by: a granularity the
    backend takes for it, a group size, maybe an embedding scheme, calibration draws for a
    static scheme."""
    scheme = draw(st.sampled_from([s for s in schemes.SCHEMES if backend in s.backends]))
    # A backend without TorchAO's embedding ops takes no table scheme (the quantize stage refuses it).
    takes_tables = targets.BY_NAME[backend].no_table_quantization is None
    embedding = draw(st.sampled_from((None,) + (schemes.EMBEDDING_SCHEMES if takes_tables else ())))
    quantization = Quantization(
        scheme.name,
        draw(st.sampled_from(scheme.granularities(backend))),
        draw(st.sampled_from((16, 32, 64))),
        embedding,
        draw(st.sampled_from((0, 16, 32))) if embedding else 0,
        draw(st.integers(1, 3)) if scheme.needs_calibration else 0,
    )
    return draw(programs(quantization=quantization))
