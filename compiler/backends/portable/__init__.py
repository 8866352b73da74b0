"""The portable backend: nothing is delegated, every op runs on ExecuTorch's CPU kernels."""

from __future__ import annotations

from torch.export import ExportedProgram

from compiler.backends.base import Backend, BackendPartition
from compiler.ir.targets import DYNAMIC, PER_CHANNEL
from compiler.models.llm_ops import LLAMA


class PortableBackend(Backend):
    name = "portable"
    llm_ops = LLAMA

    @classmethod
    def pt2e_quantizer(cls, scheme, granularity: str):
        """XNNPACK's: its annotations are plain quantized_decomposed ops, which the portable
        runtime's quantized kernels run."""
        from compiler.backends.xnnpack.quantizer import pt2e_quantizer

        return pt2e_quantizer(granularity == PER_CHANNEL, scheme.activations == DYNAMIC)

    def partition(self, program: ExportedProgram) -> BackendPartition:
        return BackendPartition(partitions={})

    def default_cpu_reason(self, node) -> str:
        return "the portable backend runs every op on the CPU; pick a delegate backend (xnnpack, coreml, mlx) to delegate it"
