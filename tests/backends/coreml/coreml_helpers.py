"""Helpers for the Core ML backend tests (a uniquely named module: every test folder has a conftest): compile with ours, run the stock path, read payloads."""

import logging
import warnings

import torch

import compiler
from compiler.backends.coreml.payload import read_models


def export(model, inputs):
    with torch.no_grad():
        return torch.export.export(model.eval(), inputs, strict=False)


def stock_error(model, inputs, **partitioner_options) -> str:
    """What stock ExecuTorch 1.5.1 does with this model: '' if it builds, else the error text."""
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = export(model, inputs)
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            to_edge_transform_and_lower(
                program, partitioner=[CoreMLPartitioner(**partitioner_options)]
            ).to_executorch()
    except Exception as exc:  # whatever stock raises is what we show
        return f"{type(exc).__name__}: {exc}"
    finally:
        logging.disable(logging.NOTSET)
    return ""


def stock_pte(model, inputs, **partitioner_options) -> bytes:
    from executorch.backends.apple.coreml.partition import CoreMLPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = export(model, inputs)
    return to_edge_transform_and_lower(
        program, partitioner=[CoreMLPartitioner(**partitioner_options)]
    ).to_executorch().buffer


def compile_coreml(model, inputs, **backend_options):
    return compiler.compile(model.eval(), inputs, "coreml", backend_options=backend_options or None)


def cpu_ops(artifact) -> dict[str, str]:
    """Node name -> op, for the ops the placement plan leaves on the CPU."""
    return {p.node: p.op for p in artifact.program.plan.cpu_nodes}


def cpu_reasons(artifact) -> dict[str, str]:
    return {p.node: p.reason for p in artifact.program.plan.cpu_nodes}


def delegated_ops(artifact) -> list[str]:
    return sorted(p.op for p in artifact.program.plan.delegated_nodes)


def models(artifact):
    return read_models(artifact.pte)




def assert_matches_eager(artifact, model, inputs, tolerance=None):
    """Run the program (Core ML payloads through the MIL interpreter) and compare with eager,
    at the tolerance of the precision it computes in unless one is given."""
    check = compiler.compare_with_eager(artifact, model.eval(), inputs, tolerance)
    assert check.passed, check
