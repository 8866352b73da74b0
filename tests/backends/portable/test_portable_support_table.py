"""One-op programs on the portable backend: every limit of the portable kernels is real, and
our compile runs the call right or refuses it before anything runs.

`compiler/ir/kernel_limits.py` lists inputs the portable runtime's kernels refuse although
torch takes them. LIMIT_CASES holds, per limit, the smallest one-op program over it. With
the limit table switched off (the compiler before it had one) that program compiles and the
runtime refuses it, or the process dies (run in a child process); with the table on, the
program runs and equals eager (every limit has a rewrite), and where a rewrite cannot
apply (symbolic sizes) the compile fails in the partition stage naming the node and the
kernel's check.

Then the sweep: each op of SWEPT (common model ops, the limited ones among them) alone in a
program over input ranks 0 to 5 where eager takes them, and with each non-tensor argument
off its default (tests/backends/op_programs.py's OpSweep, as the XNNPACK and MLX sweeps do):
it runs and equals eager. The default run
takes the limit cases (but the one that crashes the runtime: a child process starts slowly)
and the base cases of the limited ops; `-m slow` adds the rest, every rank and every
argument variant.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Callable

import pytest
import torch
from backends.op_programs import (  # tests/backends/op_programs.py, shared with the XNNPACK and MLX sweeps
    OneOp,
    OpSweep,
    compare,
    eager,
    idx as _idx,
    tensor as _t,
    weight as _w,
)

import compiler
from compiler.ir import kernel_limits
from compiler.ir.errors import VerificationError

aten = torch.ops.aten
F32 = torch.float32
Inputs = Callable[[torch.dtype], tuple[tuple, dict]]


def _conv(rank: int, transposed: bool = False) -> Inputs:
    """A convolution over an input of `rank` (3: 1-D, 4: 2-D, 5: 3-D), stride 2 and padding 1 on every axis."""
    n = rank - 2
    weight = (3, 2) + (3,) * n if transposed else (2, 3) + (3,) * n  # transposed: (in, out, ...)
    return lambda d: (
        (_t((3, 3) + (5,) * n, d), _w(weight, d), _w((2,), d), [2] * n, [1] * n, [1] * n, transposed, [0] * n, 1),
        {},
    )


# Limit name -> (op, inputs, how the runtime fails without the rule: "refuses" (execute
# returns an error) or "crashes" (the process dies)).
LIMIT_CASES: dict[str, tuple[Any, Inputs, str]] = {
    "conv3d": (aten.convolution.default, _conv(5), "refuses"),
    "conv_transpose3d": (aten.convolution.default, _conv(5, transposed=True), "refuses"),
    "cumsum_0d": (aten.cumsum.default, lambda d: ((_t((), d), 0), {}), "refuses"),
    "sum_0d": (aten.sum.dim_IntList, lambda d: ((_t((), d), [-1]), {}), "crashes"),
    "pad_negative": (aten.constant_pad_nd.default, lambda d: ((_t((3, 5), d), [-1, 2, 1, -2], 0.5), {}), "refuses"),
    # irfft over the first dim decomposes to a cast to complex and `_fft_c2r` over dim 0.
    "fft_c2r_inner_dim": (aten.fft_irfft.default, lambda d: ((_t((5, 6, 7), d), None, 0), {}), "refuses"),
    # rfft over the first dim, returned as it is: `_fft_r2c` over dim 0, its complex result the output.
    "fft_r2c_inner_dim": (aten.fft_rfft.default, lambda d: ((_t((5, 6, 7), d), None, 0), {}), "refuses"),
    "gather_int32_index": (aten.gather.default, lambda d: ((_t((3, 5), d), 1, _int32(0, 4, 1, 1, 3, 2)), {}), "refuses"),
    "scatter_src_int32_index": (
        aten.scatter.src, lambda d: ((_t((3, 5), d), 1, _int32(0, 4, 1, 1, 3, 2), _t((3, 2), d)), {}), "refuses",
    ),
    "scatter_value_int32_index": (
        aten.scatter.value, lambda d: ((_t((3, 5), d), 1, _int32(0, 4, 1, 1, 3, 2), 2.5), {}), "refuses",
    ),
}
# Limits whose rewrite needs no size (a cast of the index): it holds over symbolic sizes too.
REWRITTEN_AT_ANY_SIZE = ("gather_int32_index", "scatter_src_int32_index", "scatter_value_int32_index")
LIMITS = {limit.name: limit for limit in kernel_limits.KERNEL_LIMITS}

# A child process runs a program whose kernel aborts: only the child dies.
_CHILD = "import sys, torch, compiler; compiler.run(sys.argv[1], torch.load(sys.argv[2]))"


def _int32(*values: int) -> torch.Tensor:
    """Three rows of indices, int32 (torch takes them; the portable kernels read int64 only)."""
    return torch.tensor(values, dtype=torch.int32).reshape(3, -1)


def _program(op, inputs: Inputs, dtype: torch.dtype = F32) -> OneOp:
    torch.manual_seed(0)
    args, kwargs = inputs(dtype)
    return OneOp(op, args, kwargs).eval()


def _without_limits(monkeypatch) -> None:
    """The compiler before the limit table: no call is over a limit, so none is rewritten or refused."""
    monkeypatch.setattr(kernel_limits, "_BY_OP", {})


def test_the_limit_cases_are_the_table_and_each_is_over_its_limit_only(monkeypatch):
    assert set(LIMIT_CASES) == set(LIMITS)
    for name, (op, inputs, _) in LIMIT_CASES.items():
        module = _program(op, inputs)
        with monkeypatch.context() as patch:
            _without_limits(patch)
            program = compiler.compile(module, module.example, backend="portable", stop_after="partition").artifact.program
        hits = [kernel_limits.kernel_limit(node) for node in program.graph.nodes]
        assert [limit.name for limit in hits if limit] == [name]


@pytest.mark.parametrize(
    "name",  # a child process takes seconds to start: the crash is shown with -m slow
    [pytest.param(name, marks=[pytest.mark.slow] * (case[2] == "crashes")) for name, case in LIMIT_CASES.items()],
)
def test_without_the_limit_the_call_compiles_and_the_runtime_refuses_it(name, monkeypatch, tmp_path):
    op, inputs, failure = LIMIT_CASES[name]
    module = _program(op, inputs)
    _without_limits(monkeypatch)
    artifact = compiler.compile(module, module.example, backend="portable")  # the kernel exists
    if failure == "refuses":
        with pytest.raises(RuntimeError, match="execute"):
            compiler.run(artifact, module.example)
        return
    artifact.save(str(tmp_path / "program.pte"))
    torch.save(module.example, tmp_path / "inputs.pt")
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "program.pte"), str(tmp_path / "inputs.pt")],
        capture_output=True,
        timeout=300,
    )
    assert child.returncode < 0, (child.returncode, child.stderr[-2000:])  # killed by a signal (an abort)


@pytest.mark.parametrize("name", list(LIMIT_CASES))
def test_our_compile_rewrites_the_call_and_it_runs_as_in_eager(name):
    op, inputs, _ = LIMIT_CASES[name]
    module = _program(op, inputs)
    artifact = compiler.compile(module, module.example, backend="portable")
    compare(compiler.run(artifact, module.example), eager(module))


# A rewrite needs sizes it can compute with: over symbolic sizes the call stays as it is
# and the compile is refused (a 0-d input has no size to make symbolic).
@pytest.mark.parametrize(
    "name", [name for name, case in LIMIT_CASES.items() if case[1](F32)[0][0].dim() and name not in REWRITTEN_AT_ANY_SIZE]
)
def test_with_symbolic_sizes_the_call_is_refused_at_compile_time_by_name(name):
    op, inputs, _ = LIMIT_CASES[name]
    module = _program(op, inputs)
    dynamic = (({0: torch.export.Dim("batch", min=3, max=8)},),)  # forward(*tensors): one tuple
    with pytest.raises(VerificationError) as caught:
        compiler.compile(module, module.example, backend="portable", dynamic_shapes=dynamic)
    error, limit = caught.value, LIMITS[name]
    assert (error.stage, error.invariant) == ("partition", "cpu_ops_have_kernels")
    assert len(error.nodes) == 1 and error.nodes[0].startswith(limit.op.replace(".", "_").lower() + " (")
    assert limit.source in error.nodes[0] and limit.reason in error.nodes[0]
    assert "kernel_limits.py" in error.hint


@pytest.mark.parametrize("name", REWRITTEN_AT_ANY_SIZE)
def test_a_rewrite_needing_no_size_runs_over_symbolic_sizes_as_in_eager(name):
    op, inputs, _ = LIMIT_CASES[name]
    module = _program(op, inputs)
    # The first input's columns (not the dim gathered along) vary.
    dynamic = (({1: torch.export.Dim("columns", min=5, max=8)},) + (None,) * (len(module.example) - 1),)
    artifact = compiler.compile(module, module.example, backend="portable", dynamic_shapes=dynamic)
    compare(compiler.run(artifact, module.example), eager(module))


# --- the sweep ------------------------------------------------------------------------

SIZES = (2, 3, 4, 5, 6)


def _shape(rank: int) -> tuple[int, ...]:
    return SIZES[:rank]


def _image(rank: int) -> tuple[int, ...]:
    """Channels and 5 x 5 pixels, under as many batch dims as `rank` leaves (a pool's input)."""
    return (1,) * (rank - 3) + (2, 5, 5) if rank >= 3 else (5,) * rank


# Label -> (op, rank -> inputs): common model ops with a portable kernel, each over an
# input of the given rank (eager says which ranks the op takes). Dim arguments count from
# the end, so each rank has them.
SWEPT: dict[str, tuple[Any, Callable[[int], Inputs]]] = {
    "aten.convolution.default": (aten.convolution.default, lambda r: _conv(r)),
    "aten.convolution.default-transposed": (aten.convolution.default, lambda r: _conv(r, transposed=True)),
    "aten.cumsum.default": (aten.cumsum.default, lambda r: lambda d: ((_t(_shape(r), d), -1), {})),
    "aten.sum.dim_IntList": (aten.sum.dim_IntList, lambda r: lambda d: ((_t(_shape(r), d), [-1]), {})),
    "aten.mean.dim": (aten.mean.dim, lambda r: lambda d: ((_t(_shape(r), d), [-1]), {})),
    "aten.amax.default": (aten.amax.default, lambda r: lambda d: ((_t(_shape(r), d), [-1]), {})),
    "aten.argmax.default": (aten.argmax.default, lambda r: lambda d: ((_t(_shape(r), d), -1), {})),
    "aten._softmax.default": (aten._softmax.default, lambda r: lambda d: ((_t(_shape(r), d), -1, False), {})),
    "aten.constant_pad_nd.default": (
        aten.constant_pad_nd.default,
        lambda r: lambda d: ((_t(_shape(r), d), [1, 2]), {}),
    ),
    "aten.index_select.default": (
        aten.index_select.default,
        lambda r: lambda d: ((_t(_shape(r), d), -1, _idx(0, 1) if r else _idx(0)), {}),
    ),
    "aten.flip.default": (aten.flip.default, lambda r: lambda d: ((_t(_shape(r), d), [-1]), {})),
    "aten.avg_pool2d.default": (aten.avg_pool2d.default, lambda r: lambda d: ((_t(_image(r), d), [2, 2]), {})),
    "aten.max_pool2d_with_indices.default": (
        aten.max_pool2d_with_indices.default,
        lambda r: lambda d: ((_t(_image(r), d), [2, 2]), {}),
    ),
    "aten.gather.default": (
        aten.gather.default,
        lambda r: lambda d: ((_t(_shape(r), d), -1, torch.zeros(_shape(r)[:-1] + (1,), dtype=torch.int64)), {}),
    ),
    "aten.max.dim": (aten.max.dim, lambda r: lambda d: ((_t(_shape(r), d), -1), {})),
    "aten.argmin.default": (aten.argmin.default, lambda r: lambda d: ((_t(_shape(r), d), -1), {})),
    "aten.topk.default": (aten.topk.default, lambda r: lambda d: ((_t(_shape(r), d), 1, -1), {})),
    "aten.var.correction": (aten.var.correction, lambda r: lambda d: ((_t(_shape(r), d), [-1]), {"correction": 0})),
    "aten.prod.dim_int": (aten.prod.dim_int, lambda r: lambda d: ((_t(_shape(r), d), -1), {})),
    "aten.any.dims": (aten.any.dims, lambda r: lambda d: ((_t(_shape(r), torch.bool), [-1]), {})),
    "aten._adaptive_avg_pool2d.default": (
        aten._adaptive_avg_pool2d.default,
        lambda r: lambda d: ((_t(_image(r), d), [2, 3]), {}),
    ),
    "aten.upsample_nearest2d.vec": (
        aten.upsample_nearest2d.vec,
        lambda r: lambda d: ((_t(_image(r), d), None, [2.0, 1.5]), {}),
    ),
    "aten.native_layer_norm.default": (
        aten.native_layer_norm.default,
        lambda r: lambda d: ((_t(_shape(r), d), list(_shape(r)[-1:]), None, None, 1e-5), {}),
    ),
}
BASE_RANK = {"aten.convolution.default": 4, "aten.convolution.default-transposed": 4}  # others: 3
RANKS = (0, 1, 2, 3, 4, 5)


def _ranked(label: str, rank: int) -> OneOp | None:
    op, inputs = SWEPT[label]
    if rank < 2 and label.startswith("aten.convolution"):
        return None
    module = _program(op, inputs(rank))
    return module if eager(module) is not None else None


def _check(module: OneOp) -> None:
    """The program runs on the portable runtime and equals eager."""
    artifact = compiler.compile(module, module.example, backend="portable")
    compare(compiler.run(artifact, module.example), eager(module))


def _op(label: str):
    return SWEPT[label][0]


# OpSweep's argument variants start from the base rank's program.
SWEEP = OpSweep(
    claimed=lambda: {label: _op(label) for label in SWEPT},
    overrides={label: SWEPT[label][1](BASE_RANK.get(label, 3)) for label in SWEPT},
    variant_inputs={},
    values={
        ("aten.convolution.default", "transposed"): False,  # the weights are not a transposed one's
        ("aten.convolution.default-transposed", "transposed"): True,
    },
    first_dtypes=(F32,),
)


def _limited(label: str) -> bool:
    return any(limit.op == str(_op(label)) for limit in LIMITS.values())


def _rank_cases(sample: bool) -> list:
    """The sample: the base rank of each op with a kernel limit; else every other case."""
    return [
        pytest.param(label, rank, id=f"{label}-rank{rank}")
        for label in SWEPT
        for rank in RANKS
        if (rank == BASE_RANK.get(label, 3) and _limited(label)) == sample
    ]


@pytest.mark.parametrize("label, rank", _rank_cases(sample=True))
def test_each_limited_op_alone_at_its_base_rank(label, rank):
    module = _ranked(label, rank)
    assert module is not None, "eager takes the base case"
    _check(module)


@pytest.mark.slow
@pytest.mark.parametrize("label, rank", _rank_cases(sample=False))
def test_each_op_alone_at_every_rank_eager_takes(label, rank):
    module = _ranked(label, rank)
    if module is None:
        pytest.skip("eager refuses this rank")
    _check(module)


def _argument_cases() -> list:
    return [
        pytest.param(label, argument.name, id=f"{label}-{argument.name}")
        for label in SWEPT
        for argument in SWEEP.varied_arguments(label)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("label, name", _argument_cases())
def test_each_argument_off_its_default(label, name):
    argument = next(a for a in SWEEP.varied_arguments(label) if a.name == name)
    changes, note = SWEEP.variant(label, argument, F32)
    if changes is None:
        pytest.skip(note)
    module = SWEEP.variant_program(label, F32, changes)
    _check(module)
