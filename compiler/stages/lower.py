"""Lower: partitioned program -> program whose tagged parts are backend payloads.

The partition search already ran; lowering replays its tags through
ExecuTorch's `to_backend`, whose backend `preprocess` builds each payload.
Unless the run option `dependency_checks` is on, the checks `to_backend` and the
backend's converter repeat after every step are skipped: our verification checks
the stage's input and output.
"""

from __future__ import annotations

import contextlib

import torch
from torch.export import ExportedProgram

from executorch.exir.backend.backend_api import MethodProgramsPartitionerSpec, to_backend
from executorch.exir.backend.partitioner import Partitioner, PartitionResult

from compiler.process.collector import collect
from compiler.ir.artifacts import LoweredProgram, SplitProgram
from compiler.ir.graph import DELEGATION_TAG, legalize_in_place
from compiler.ir.placement import PlacementPlan
from compiler.ir.program_data import SPILL_BLOB_BYTES, spill_directory
from compiler.ir.private_api import (
    blobs_spilled,
    constants_kept,
    partitions_fused_without_graph_copies,
    tagged_constants_found_in_one_signature_read,
)
from compiler.stages.base import Stage, StageContext
from compiler.ir.artifacts import METHOD
from compiler.reporting.progress import WeightsWritten
from compiler.reporting.report import Metric


class ReplayPartitioner(Partitioner):
    """Tags the program `to_backend` hands it exactly as the placement plan says."""

    def __init__(self, plan: PlacementPlan) -> None:
        super().__init__()
        self.plan = plan

    def partition(self, exported_program: ExportedProgram) -> PartitionResult:
        tags = self.plan.tags()
        for node in exported_program.graph.nodes:
            node.meta.pop(DELEGATION_TAG, None)
            if node.name in tags:
                node.meta[DELEGATION_TAG] = tags[node.name]
        return PartitionResult(exported_program, dict(self.plan.partitions))


def _constant_bytes(program) -> int:
    """What the program's weights and constant buffers hold: about what its payloads will."""
    tensors = {id(t): t for t in (*program.state_dict.values(), *program.constants.values()) if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Lower(Stage, takes=SplitProgram, returns=LoweredProgram):
    metrics = (Metric.plain("collect_s", "s"),)

    def apply(self, partitioned: SplitProgram, ctx: StageContext) -> LoweredProgram:
        if not partitioned.plan.partitions:
            return LoweredProgram(partitioned.program, partitioned.plan, partitioned.preserved_ops)
        spec = MethodProgramsPartitionerSpec(
            {METHOD: partitioned.program}, {METHOD: ReplayPartitioner(partitioned.plan)}
        )
        with contextlib.ExitStack() as stack:
            # `to_backend` deletes the constants delegates take from its input's table: the
            # stage's input keeps its own (it is the partition stage's artifact).
            stack.enter_context(constants_kept(partitioned.program))
            stack.enter_context(ctx.backend.lowering(ctx.dependency_checks))
            # `to_backend` re-sorts the whole graph by copying it after fusing each partition:
            # the same order in place, so a partition's fusion costs its own size, not the program's.
            stack.enter_context(partitions_fused_without_graph_copies(legalize_in_place))
            stack.enter_context(tagged_constants_found_in_one_signature_read())
            stack.enter_context(ctx.program_checks_skipped())
            # Each weight a payload stores as named data goes to a file as it is made: held in
            # memory, the payloads would be a second copy of the weights until emit.
            written = WeightsWritten(_constant_bytes(partitioned.program))
            stack.enter_context(blobs_spilled(spill_directory(), SPILL_BLOB_BYTES, written))
            lowered = to_backend(spec)[METHOD]
        # `to_backend` deep-copies each partition's program, weights included, for the
        # backend's `preprocess`, whose passes keep the copy in reference cycles. Left to the
        # collector's schedule they can outlive this stage and sit under emit's `.pte`
        # (XNNPACK, depth-12 stack: peak heap growth 150 MB -> 127 MB; stock's 130).
        ctx.metrics["collect_s"] = collect()
        return LoweredProgram(lowered, partitioned.plan, partitioned.preserved_ops)
