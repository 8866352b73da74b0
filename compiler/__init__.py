"""A staged compiler driver from PyTorch models to ExecuTorch programs.

    artifact = compiler.compile(model, (x,), backend="xnnpack")
    outputs = compiler.run(artifact, (x,))

Names are imported on first use, so `python -m compiler` can quiet the
import-time noise of its dependencies before they load.
"""

import importlib

_EXPORTS = {
    "CompileResult": "compiler.api",
    "compile": "compiler.api",
    "compile_methods": "compiler.api",
    "check_methods": "compiler.api",
    "MethodsResult": "compiler.api",
    "Instrument": "compiler.driver.instruments",
    "CompileConfig": "compiler.driver.config",
    "DriverOptions": "compiler.driver.config",
    "compare_with_eager": "compiler.running.runtime",
    "LoadedProgram": "compiler.running.runtime",
    "run": "compiler.running.runtime",
    "share_weights": "compiler.ir.shared_weights",
    "STAGE_NAMES": "compiler.stages",
    "CaptureError": "compiler.ir.errors",
    "CompileError": "compiler.ir.errors",
    "PipelineError": "compiler.ir.errors",
    "ResumeError": "compiler.ir.errors",
    "StageFailure": "compiler.ir.errors",
    "UnsupportedByRuntime": "compiler.ir.errors",
    "UnsupportedOp": "compiler.ir.errors",
    "UserInputError": "compiler.ir.errors",
    "VerificationError": "compiler.ir.errors",
    "sweep": "compiler.tools.sweeps",
    "generate": "compiler.tools.generation",
    "compile_job": "compiler.tools.compile_job",
    "check_nodes": "compiler.tools.locate.every_node",
    "locate": "compiler.tools.locate",
    "locate_result": "compiler.tools.locate",
    "locate_program": "compiler.tools.locate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'compiler' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    value = getattr(module, name)
    globals()[name] = value
    return value
