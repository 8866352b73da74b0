"""What a backend should do with a program, and what ours and stock ExecuTorch did.

Ours must compile the program or refuse it with one of our named errors; where the
program runs on this machine, every output must match eager PyTorch (same shape and
dtype, values within the program's noise). The stock path (`torch.export` +
`to_edge_transform_and_lower` with the backend's ExecuTorch partitioner) is judged
the same way, so the table can say where we are right and stock is not.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Callable

import attrs
import torch
from torch.utils import _pytree as pytree

import compiler
from compiler.tools.fuzz.programs import Program, Reproducer
from compiler.ir.errors import CompileError, StageFailure, UnsupportedByRuntime
from compiler.running.runtime import LoadedProgram

OK, COMPILED, NAMED, WRAPPED, RAW, WRONG, INVALID = (
    "ok", "compiled", "named error", "wrapped error", "raw exception", "wrong result", "invalid program",
)
# Outcomes that are bugs of ours (stock's failures are only recorded).
FAILURES = (WRAPPED, RAW, WRONG)


@attrs.frozen
class Outcome:
    kind: str
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.kind in (OK, COMPILED)


@contextlib.contextmanager
def _quiet():
    """Dependencies warn, log and draw progress bars freely while compiling; a fuzz table
    should not drown in it."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def eager_outputs(program: Program | Reproducer) -> list[list[torch.Tensor]]:
    """Eager PyTorch's outputs for each of the program's calls (state carries between them)."""
    model, inputs = program.build()
    with torch.no_grad():
        # Cloned: a returned buffer is the same tensor on every call.
        return [[t.clone() for t in pytree.tree_leaves(model(*inputs))] for _ in range(program.calls)]


def compare(program: Program | Reproducer, got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> str | None:
    """Why `got` is not eager's `want`, or None when every output matches."""
    for call, (outputs, expected) in enumerate(zip(got, want, strict=True)):
        if len(outputs) != len(expected):
            return f"call {call}: {len(outputs)} outputs, eager has {len(expected)}"
        for i, (g, w) in enumerate(zip(outputs, expected, strict=True)):
            where = f"call {call} output {i} ({program.names[i]}, {w.dtype})"
            if g.dtype != w.dtype:
                return f"{where}: dtype {g.dtype}, eager {w.dtype}"
            if g.shape != w.shape:
                return f"{where}: shape {tuple(g.shape)}, eager {tuple(w.shape)}"
            if not g.numel():
                continue
            g64, w64 = g.to(torch.float64), w.to(torch.float64)
            if not torch.equal(g64.isnan(), w64.isnan()) or not torch.equal(g64.isinf() & (g64 == w64), w64.isinf()):
                return f"{where}: NaN or infinity where eager has none, or the reverse"
            finite = w64.isfinite()
            if finite.any():
                error = (g64[finite] - w64[finite]).abs().max().item()
                scale = max(1.0, w64[finite].abs().max().item())
                allowed = program.tolerances[i] * scale
                if error > allowed:
                    return f"{where}: max abs error {error:.3g} (allowed {allowed:.3g})"
    return None


def _run(pte_or_artifact, program: Program | Reproducer, inputs: tuple) -> list[list[torch.Tensor]]:
    loaded = LoadedProgram(pte_or_artifact)
    return [loaded(inputs) for _ in range(program.calls)]


def _judge(program: Program | Reproducer, inputs: tuple, build: Callable[[], object], want) -> Outcome:
    """Run what `build` made against eager; the failure kinds of running only."""
    try:
        got = _run(build(), program, inputs)
    except UnsupportedByRuntime:
        return Outcome(COMPILED)
    except CompileError as error:
        return Outcome(NAMED, f"run: {_first_line(error)}")
    except Exception as error:  # a program that compiled but does not run is a bug
        return Outcome(RAW, f"run: {_first_line(error)}")
    mismatch = compare(program, got, want)
    return Outcome(WRONG, mismatch) if mismatch else Outcome(OK)


def core_ml_float32() -> list:
    """Core ML's compile spec for float32 compute precision. Core ML programs are fuzzed
    with it, ours and stock's alike: the oracle checks what a program computes, at the
    programs' float32 tolerances, not float16's rounding (which `--check` judges with
    its own tolerance)."""
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    return [CoreMLBackend.generate_compute_precision_compile_spec(ct.precision.FLOAT32)]


def backend_options(backend: str) -> dict | None:
    """The options both paths compile a fuzzed program with."""
    return {"compile_specs": core_ml_float32()} if backend == "coreml" else None


def ours(program: Program | Reproducer, backend: str, want) -> Outcome:
    model, inputs = program.build()
    with _quiet():
        try:
            artifact = compiler.compile(model, inputs, backend, backend_options=backend_options(backend))
        except StageFailure as error:
            return Outcome(WRAPPED, _first_line(error.__cause__ or error))
        except CompileError as error:
            return Outcome(NAMED, _first_line(error))
        except Exception as error:
            return Outcome(RAW, _first_line(error))
        return _judge(program, inputs, lambda: artifact, want)


def stock_partitioners(backend: str) -> list:
    """The partitioners stock ExecuTorch lowers with for `backend` (default options)."""
    if backend == "portable":
        return []
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return [XnnpackPartitioner()]
    if backend == "coreml":
        from executorch.backends.apple.coreml.partition import CoreMLPartitioner

        return [CoreMLPartitioner(**backend_options(backend))]
    if backend == "mlx":
        from compiler.backends.mlx.generated import ensure_generated

        ensure_generated()
        from executorch.backends.mlx.partitioner import MLXPartitioner

        return [MLXPartitioner()]
    raise ValueError(f"no stock path for backend {backend!r}")


def stock(program: Program | Reproducer, backend: str, want) -> Outcome:
    """Stock ExecuTorch on the same program: every failure is only recorded, as 'named error'."""
    from executorch.exir import to_edge_transform_and_lower

    model, inputs = program.build()
    with _quiet():
        try:
            exported = torch.export.export(model, inputs)
        except Exception as error:
            return Outcome(INVALID, _first_line(error))
        try:
            pte = to_edge_transform_and_lower(exported, partitioner=stock_partitioners(backend)).to_executorch().buffer
        except Exception as error:
            return Outcome(NAMED, _first_line(error))
        return _judge(program, inputs, lambda: pte, want)


def replay(path: str, backend: str | None = None) -> Outcome:
    """Run a reproducer file through our pipeline and print what happened."""
    program = Reproducer.load(path)
    backend = backend or program.backend
    outcome = ours(program, backend, eager_outputs(program))
    print(f"{backend}: {outcome.kind}{': ' + outcome.detail if outcome.detail else ''}")
    return outcome
