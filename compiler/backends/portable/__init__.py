"""The portable backend: nothing is delegated, every op runs on ExecuTorch's CPU kernels."""

from __future__ import annotations

from torch.export import ExportedProgram

from compiler.backends.base import Backend, BackendPartition


class PortableBackend(Backend):
    name = "portable"

    def partition(self, program: ExportedProgram) -> BackendPartition:
        return BackendPartition(partitions={})

    def default_cpu_reason(self, node) -> str:
        return "the portable backend runs every op on the CPU; pick a delegate backend (xnnpack, coreml, mlx) to delegate it"
