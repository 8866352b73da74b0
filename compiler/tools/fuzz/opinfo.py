"""PyTorch's OpInfo database (`op_db`) as a differential suite, judged by the fuzz oracle.

Every op of `torch.testing._internal.common_methods_invocations.op_db` that takes float32 on
the CPU comes with sample inputs (`op.sample_inputs("cpu", torch.float32)`). One op on one
sample is a case: a module whose forward calls `op(input, *args, **kwargs)`, its tensors the
forward's inputs, everything else held as constants. Ours compiles it for a backend and stock
ExecuTorch beside it, both run here and are compared with eager (`oracle.ours`, `oracle.stock`),
and each outcome is classed: pass, named refusal, wrapped error, raw exception, wrong result.

A sample eager cannot run, whose outputs are not all tensors, that draws random numbers, or
whose outputs differ between two runs (uninitialised memory) is no case. The draw is fixed by its seed: the
same ops and samples on every run and every machine.
"""

from __future__ import annotations

import functools
import logging
import math
import random
from typing import Any, Callable

import attrs
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from compiler.tools.fuzz import oracle
from compiler.tools.fuzz.oracle import Outcome

logger = logging.getLogger(__name__)

SEED = 7
OPS = 140
SAMPLES_PER_OP = 2
# The normwise error a float32 output may show, times the square root of the elements of the op's
# largest input: transcendental functions differ by a few ulps between libraries, reductions
# accumulate in other orders.
FLOAT32_NOISE = 8e-6
# Outcome classes of the table, in its column order; stock's failures are only recorded.
PASS, NAMED, WRAPPED, RAW, WRONG = "pass", "named refusal", "wrapped error", "raw", "wrong"
COLUMNS = (PASS, NAMED, WRAPPED, RAW, WRONG)
_CLASS = {
    oracle.OK: PASS, oracle.COMPILED: PASS, oracle.NAMED: NAMED, oracle.WRAPPED: WRAPPED,
    oracle.RAW: RAW, oracle.WRONG: WRONG, oracle.INVALID: NAMED,
}


def outcome_class(outcome: Outcome) -> str:
    """The table's column for one of the oracle's outcomes."""
    return _CLASS[outcome.kind]


class OpCall(torch.nn.Module):
    """`op(input, *args, **kwargs)` of one sample: the sample's tensors come in as the forward's
    inputs, in the order pytree flattens the sample; every other leaf is a constant."""

    def __init__(self, op: Callable, spec: pytree.TreeSpec, leaves: list[Any]) -> None:
        super().__init__()
        self.op, self.spec = op, spec
        self.constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]

    def forward(self, *tensors: torch.Tensor):
        given = iter(tensors)
        leaves = [next(given) if constant is None else constant for constant in self.constants]
        sample_input, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.op(sample_input, *args, **kwargs)


@attrs.frozen(eq=False)
class OpSample:
    """One op on one sample, with what the fuzz oracle asks of a program (`build`, `calls`,
    `tolerances`, `names`, `quantization`)."""

    op: str  # op_db's name, with its variant after a dot
    sample: int  # the sample's place among the op's float32 samples
    function: Callable
    spec: pytree.TreeSpec
    leaves: tuple
    tolerances: tuple[float, ...]
    calls: int = 1
    quantization: None = None

    @property
    def id(self) -> str:
        return f"{self.op}-{self.sample}"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"{self.op}[{i}]" for i in range(len(self.tolerances)))

    def build(self) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        """The module and fresh copies of its inputs (an op may write into its input)."""
        inputs = tuple(leaf.clone() for leaf in self.leaves if isinstance(leaf, torch.Tensor))
        return OpCall(self.function, self.spec, list(self.leaves)).eval(), inputs

    def calibration(self) -> list:
        return []


def _tolerance(output: torch.Tensor, read: int) -> float:
    """The normwise error a float output may show, `read` the elements of the op's largest input;
    integers and bools must be exact."""
    if not output.is_floating_point() and not output.is_complex():
        return 0.0
    return FLOAT32_NOISE * math.sqrt(max(read, 1))


class _RandomOps(TorchDispatchMode):
    """Records whether an op called draws random numbers: OpInfo reseeds its random ops inside
    the call, so eager repeats itself, but no compiled program draws torch's numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen |= torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


def _same(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.nan_to_num(), b.nan_to_num())
        for a, b in zip(first, second)
    )


def _eager(sample: OpSample) -> list[torch.Tensor] | None:
    """The sample's outputs in eager PyTorch, or None when they are not all tensors."""
    model, inputs = sample.build()
    with torch.no_grad():
        outputs = pytree.tree_leaves(model(*inputs))
    if not outputs or not all(isinstance(t, torch.Tensor) for t in outputs):
        return None
    return [t.clone() for t in outputs]


def _case(name: str, index: int, function: Callable, sample) -> OpSample | None:
    """The case of one sample, or None when eager cannot run it, its outputs are not all tensors,
    it draws random numbers or two runs differ (memory it leaves unwritten)."""
    leaves, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if any(t.layout != torch.strided or t.requires_grad for t in tensors):
        return None
    leaves = [leaf.detach().contiguous().clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    read = max((t.numel() for t in tensors), default=1)
    case = OpSample(name, index, function, spec, tuple(leaves), ())
    random_ops = _RandomOps()
    try:
        with random_ops:
            first = _eager(case)
        second = _eager(case)
    except Exception as error:  # a sample eager refuses is no case
        logger.debug("%s sample %d: eager raised %s", name, index, error)
        return None
    if first is None or second is None or random_ops.seen or not _same(first, second):
        return None
    return attrs.evolve(case, tolerances=tuple(_tolerance(t, read) for t in first))


def _float32_ops() -> list:
    """op_db's ops that take float32 on the CPU and whose outputs are determined by their inputs,
    by name."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [
        op for op in op_db
        if torch.float32 in op.supported_dtypes("cpu") and not op.has_nondeterministic_output
    ]
    return sorted(ops, key=_name)


def _name(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _cases_of(op, seed: int, samples: int, rng: random.Random) -> list[OpSample]:
    """Up to `samples` cases of `op`, drawn by `rng` among its usable float32 samples."""
    torch.manual_seed(seed)
    usable = []
    try:
        for index, sample in enumerate(op.sample_inputs("cpu", torch.float32)):
            case = _case(_name(op), index, op.op, sample)
            if case is not None:
                usable.append(case)
    except Exception as error:  # a sample generator that fails here gives no cases
        logger.debug("%s: its samples raised %s", _name(op), error)
    return sorted(rng.sample(usable, min(samples, len(usable))), key=lambda c: c.sample)


def draw(seed: int = SEED, ops: int = OPS, samples_per_op: int = SAMPLES_PER_OP,
         only: tuple[str, ...] = ()) -> list[OpSample]:
    """Cases of `ops` ops (each with a usable sample), picked in an order `seed` shuffles, up to
    `samples_per_op` samples each; `only`: those ops by name instead."""
    rng = random.Random(seed)
    candidates = _float32_ops()
    if only:
        candidates = [op for op in candidates if _name(op) in only]
    else:
        rng.shuffle(candidates)
    cases: list[OpSample] = []
    taken = 0
    for op in candidates:
        if taken == ops:
            break
        drawn = _cases_of(op, seed, samples_per_op, rng)
        taken += bool(drawn)
        cases += drawn
    return sorted(cases, key=lambda c: (c.op, c.sample))


@attrs.frozen
class Judged:
    """A case's outcomes on one backend: ours, and stock's (None when not run)."""

    case: OpSample
    backend: str
    ours: Outcome
    stock: Outcome | None

    def record(self) -> dict:
        return {
            "case": self.case.id, "backend": self.backend, "ours": outcome_class(self.ours),
            "ours_detail": self.ours.detail, "stock": outcome_class(self.stock) if self.stock else None,
            "stock_kind": self.stock.kind if self.stock else None,
            "stock_detail": self.stock.detail if self.stock else None,
        }


def judge(case: OpSample, backend: str, with_stock: bool = True) -> Judged:
    """Ours (and stock) on `case` for `backend`, each against eager."""
    want = oracle.eager_outputs(case)
    ours = oracle.ours(case, backend, want)
    stock = oracle.stock(case, backend, want) if with_stock else None
    return Judged(case, backend, ours, stock)


def run(cases: list[OpSample], backends: tuple[str, ...], with_stock: bool = True,
        progress: Callable[[Judged], None] | None = None) -> list[Judged]:
    """Every case on every backend, backend by backend."""
    judged = []
    for backend in backends:
        for case in cases:
            judged.append(judge(case, backend, with_stock))
            if progress:
                progress(judged[-1])
    return judged


@functools.cache
def op_names() -> tuple[str, ...]:
    """Every op name the suite can draw from."""
    return tuple(_name(op) for op in _float32_ops())
