"""A staged compiler driver from PyTorch models to ExecuTorch programs.

    artifact = compiler.compile(model, (x,), backend="xnnpack")
    outputs = compiler.run(artifact, (x,))
"""

from compiler.api import Artifact, compile, run_pipeline
from compiler.instruments import Instrument
from compiler.ir.errors import (
    CaptureError,
    CompileError,
    PipelineError,
    ResumeError,
    StageFailure,
    UnsupportedByRuntime,
    UserInputError,
    VerificationError,
)
from compiler.options import DriverOptions
from compiler.runtime import compare_with_eager, run
from compiler.stages import STAGE_NAMES

__all__ = [
    "Artifact",
    "CaptureError",
    "CompileError",
    "DriverOptions",
    "Instrument",
    "PipelineError",
    "ResumeError",
    "STAGE_NAMES",
    "StageFailure",
    "UnsupportedByRuntime",
    "UserInputError",
    "VerificationError",
    "compare_with_eager",
    "compile",
    "run",
    "run_pipeline",
]
