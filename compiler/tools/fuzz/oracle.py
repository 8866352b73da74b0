"""What a backend should do with a program, and what ours and stock ExecuTorch did.

Ours must compile the program or refuse it with one of our named errors; where the
program runs on this machine, every output must match eager PyTorch (same shape and
dtype, values within the program's noise). The stock path (`torch.export` +
`to_edge_transform_and_lower` with the backend's ExecuTorch partitioner) is judged
the same way, so the table can say where we are right and stock is not.

A quantized program (the quantize axis) is compiled by ours with the scheme's options
and by ExecuTorch's recipe for the scheme (`executorch.export`); each is compared with
its own eager quantized model by `compare_with_eager`, at that check's tolerance.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import warnings
from typing import Callable

import attrs
import torch
from torch.utils import _pytree as pytree

import compiler
from compiler import backends
from compiler.tools.fuzz.programs import Program, Quantization, Reproducer
from compiler.ir.errors import CompileError, StageFailure, UnsupportedByRuntime
from compiler.running.runtime import LoadedProgram, compare_with_eager
from compiler.stages import schemes
from compiler.stages.quantize import torchao_config

OK, COMPILED, NAMED, WRAPPED, RAW, WRONG, INVALID = (
    "ok", "compiled", "named error", "wrapped error", "raw exception", "wrong result", "invalid program",
)
# A quantized program off its eager quantized model by more than the check's tolerance, but by
# no more than quantizing moved each output from the float model's: a question for the
# tolerance, not (yet) a wrong program.
TOLERANCE = "tolerance only"
# Outputs right, but a node over its own tolerance (`compiler.check_nodes`): a fault the
# outputs hide, or a false alarm of the node check; either is a finding.
NODES = "node over tolerance"
# Outcomes that are bugs of ours (stock's failures are only recorded).
FAILURES = (WRAPPED, RAW, WRONG, NODES)


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


def _as_real(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real pairs, so both parts are compared (a real one as it is)."""
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def _unlike(where: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """How `got` differs from `want` in kind: dtype, shape, or where it is NaN or infinite."""
    if got.dtype != want.dtype:
        return f"{where}: dtype {got.dtype}, eager {want.dtype}"
    if got.shape != want.shape:
        return f"{where}: shape {tuple(got.shape)}, eager {tuple(want.shape)}"
    got, want = _as_real(got), _as_real(want)
    g64, w64 = got.to(torch.float64), want.to(torch.float64)
    if not torch.equal(g64.isnan(), w64.isnan()) or not torch.equal(g64.isinf() & (g64 == w64), w64.isinf()):
        return f"{where}: NaN or infinity where eager has none, or the reverse"
    return None


def compare(program: Program | Reproducer, got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> str | None:
    """Why `got` is not eager's `want`, or None when every output matches."""
    for call, (outputs, expected) in enumerate(zip(got, want, strict=True)):
        if len(outputs) != len(expected):
            return f"call {call}: {len(outputs)} outputs, eager has {len(expected)}"
        for i, (g, w) in enumerate(zip(outputs, expected, strict=True)):
            where = f"call {call} output {i} ({program.names[i]}, {w.dtype})"
            unlike = _unlike(where, g, w)
            if unlike:
                return unlike
            if not g.numel():
                continue
            g64, w64 = _as_real(g).to(torch.float64), _as_real(w).to(torch.float64)
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


def _judge_quantized(
    program: Program | Reproducer, inputs: tuple, build: Callable[[], object], reference: torch.nn.Module, want
) -> Outcome:
    """Run what `build` made against the eager quantized `reference` (`compare_with_eager`);
    an output off by more than the check's tolerance is wrong when it is off by more than
    quantizing moved it from the float model's `want`, else a tolerance question."""
    try:
        artifact = build()
        got = _run(artifact, program, inputs)[0]
        with torch.no_grad():
            expected = [t for t in pytree.tree_leaves(reference(*inputs)) if isinstance(t, torch.Tensor)]
        if len(got) != len(expected):
            return Outcome(WRONG, f"{len(got)} outputs, eager has {len(expected)}")
        for i, (g, q) in enumerate(zip(got, expected, strict=True)):
            unlike = _unlike(f"output {i} ({program.names[i]}, {q.dtype})", g, q)
            if unlike:
                return Outcome(WRONG, unlike)
        check = compare_with_eager(artifact, reference, inputs)
    except UnsupportedByRuntime:
        return Outcome(COMPILED)
    except CompileError as error:
        return Outcome(NAMED, f"run: {_first_line(error)}")
    except Exception as error:  # a program that compiled but does not run is a bug
        return Outcome(RAW, f"run: {_first_line(error)}")
    if check.passed:
        return Outcome(OK)
    allowed = check.tolerance.absolute
    for i, (q, w, (error, _)) in enumerate(zip(expected, want[0], check.output_errors, strict=True)):
        if error <= allowed:
            continue
        moved = (w.to(torch.float64) - q.to(torch.float64)).nan_to_num(posinf=0, neginf=0).abs().max().item()
        if not (q.is_floating_point() and error <= moved):
            return Outcome(WRONG, f"output {i} ({program.names[i]}, {q.dtype}): max abs error {error:.3g} "
                                  f"(tolerance {allowed:.3g}; quantizing moved it by {moved:.3g})")
    return Outcome(TOLERANCE, f"max abs error {check.max_abs_error:.3g} above the tolerance {allowed:.3g} "
                              f"({check.tolerance.rule}), within what quantizing moved each output")


def backend_options(backend: str) -> dict | None:
    """The options both paths compile a fuzzed program with: the backend computing in float32
    where it would compute in a lower precision by default (Core ML's float16). The oracle checks
    what a program computes, at the programs' float32 tolerances, not float16's rounding (which
    `--check` judges with its own tolerance)."""
    options = backends.load(backend).float32_options()
    return dict(options) if options is not None else None


def _calibration(program: Program | Reproducer, inputs: tuple) -> list[tuple]:
    """The samples a quantized program is calibrated with, by both paths: its inputs first
    (ExecuTorch's recipes calibrate with every example input), then those drawn again."""
    return [inputs, *program.calibration()]


def ours(program: Program | Reproducer, backend: str, want, check_nodes: bool = False) -> Outcome:
    """Ours on the program, judged against eager; with `check_nodes`, a program whose outputs
    pass has every node checked too (`compiler.check_nodes`)."""
    outcome, artifact, model, inputs = _ours(program, backend, want)
    if not (check_nodes and outcome.kind == OK):
        return outcome
    with _quiet():
        try:
            found = compiler.check_nodes(artifact, model, inputs)
        except Exception as error:  # the node check must judge every program that compiled
            return Outcome(RAW, f"check_nodes: {_first_line(error)}")
    if found.passed:
        return outcome
    first = found.first[0] if found.first else None
    detail = found.refused or (f"{first.node} ({first.op}): own error {first.output_error:.3g} over "
                               f"{first.tolerance:.3g}" if first else "")
    return Outcome(NODES, detail)


def _ours(program: Program | Reproducer, backend: str, want) -> tuple[Outcome, object, object, tuple]:
    model, inputs = program.build()
    quantization = program.quantization
    options = {}
    if quantization:
        options = quantization.options() | {"calibration": _calibration(program, inputs)}
    with _quiet():
        try:
            artifact = compiler.compile(model, inputs, backend, backend_options=backend_options(backend), **options)
        except StageFailure as error:
            return Outcome(WRAPPED, _first_line(error.__cause__ or error)), None, model, inputs
        except CompileError as error:
            return Outcome(NAMED, _first_line(error)), None, model, inputs
        except Exception as error:
            return Outcome(RAW, _first_line(error)), None, model, inputs
        if quantization:
            judged = _judge_quantized(program, inputs, lambda: artifact, artifact.stages.quantize.module, want)
        else:
            judged = _judge(program, inputs, lambda: artifact, want)
        return judged, artifact, model, inputs


def stock_partitioners(backend: str) -> list:
    """The partitioners stock ExecuTorch lowers with for `backend` (the options `backend_options` gives)."""
    return backends.load(backend).stock_partitioners(backend_options(backend))


def _is(kind: type) -> Callable[[torch.nn.Module, str], bool]:
    """TorchAO's filter for the modules of `kind`."""
    return lambda module, fqn: isinstance(module, kind)


def stock_recipe(quantization: Quantization, backend: str):
    """ExecuTorch's recipe (`executorch.export.ExportRecipe`) for the scheme on `backend`; for a
    scheme ExecuTorch has no recipe of on `backend`, one made of the scheme's TorchAO config
    and the stock partitioner."""
    from executorch.export import AOQuantizationConfig, ExportRecipe, LoweringRecipe, QuantizationRecipe, recipe_registry

    scheme = schemes.BY_NAME[quantization.scheme]
    name = scheme.recipe(backend, quantization.granularity)
    if name is None:
        config = AOQuantizationConfig(
            torchao_config(scheme, quantization.granularity, quantization.group_size, backend), _is(torch.nn.Linear)
        )
        return ExportRecipe(
            name=f"{scheme.name} ({quantization.granularity})",
            quantization_recipe=QuantizationRecipe(ao_quantization_configs=[config]),
            lowering_recipe=LoweringRecipe(partitioners=stock_partitioners(backend)),
        )
    importlib.import_module(backends.target(backend).recipes_package)
    (recipe_type,) = (t for t in recipe_registry.get_supported_recipes(backend) if t.value == name)
    kwargs = {"group_size": quantization.group_size} if quantization.granularity == schemes.PER_GROUP else {}
    if scheme.name == "codebook":
        kwargs = {"bits": 4, "block_size": [-1, quantization.group_size]}
    return ExportRecipe.get_recipe(recipe_type, **kwargs)


def _quantize_embeddings(model: torch.nn.Module, quantization: Quantization, backend: str) -> None:
    """TorchAO's config for the embedding option applied to `model`'s tables, in place: a recipe
    takes one TorchAO config ("AO quantization configs cannot be reliably composed together")."""
    from torchao.quantization import quantize_

    group = quantization.embedding_group_size
    granularity = schemes.PER_GROUP if group else schemes.PER_CHANNEL
    config = torchao_config(schemes.BY_NAME[quantization.embedding], granularity, group, backend)
    quantize_(model, config, filter_fn=_is(torch.nn.Embedding))


def _stock_quantized(program: Program | Reproducer, backend: str, want) -> Outcome:
    """ExecuTorch's recipe path (the embedding tables quantized beforehand), judged against the
    eager quantized model of its own quantize stage."""
    from executorch.export import StageType, export

    model, inputs = program.build()
    with _quiet():
        try:
            if program.quantization.embedding:
                _quantize_embeddings(model, program.quantization, backend)
            recipe = stock_recipe(program.quantization, backend)
            session = export(model, _calibration(program, inputs), export_recipe=recipe)
            pte = session.get_pte_buffer()
        except Exception as error:
            return Outcome(NAMED, _first_line(error))
        reference = session.get_stage_artifacts()[StageType.QUANTIZE].data["forward"]
        return _judge_quantized(program, inputs, lambda: pte, reference, want)


def missing_kernels(pte: bytes) -> list[str]:
    """The operators a `.pte` calls that the ExecuTorch runtime does not register: it would not
    load on a device, though the reference executor (Core ML and MLX programs here) runs its CPU
    calls with torch."""
    from compiler.ir.kernels import registered_kernels
    from compiler.ir.program_data import ProgramData, flatbuffer_program

    plans = flatbuffer_program(ProgramData(bytes(pte))).execution_plan
    called = {f"{op.name}.{op.overload}" if op.overload else op.name for plan in plans for op in plan.operators}
    return sorted(called - registered_kernels())


def stock(program: Program | Reproducer, backend: str, want) -> Outcome:
    """Stock ExecuTorch on the same program: every failure is only recorded, as 'named error'; a
    program calling an operator the runtime lacks fails there (it would not load)."""
    from executorch.exir import to_edge_transform_and_lower

    if program.quantization:
        return _stock_quantized(program, backend, want)
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
        missing = missing_kernels(pte)
        if missing:
            return Outcome(NAMED, f"the runtime has no kernel for {', '.join(missing)}: the program would not load")
        return _judge(program, inputs, lambda: pte, want)


def replay(path: str, backend: str | None = None) -> Outcome:
    """Run a reproducer file through our pipeline and print what happened."""
    program = Reproducer.load(path)
    backend = backend or program.backend
    outcome = ours(program, backend, eager_outputs(program))
    print(f"{backend}: {outcome.kind}{': ' + outcome.detail if outcome.detail else ''}")
    return outcome
