"""The interface every backend implements; stages talk only to this."""

from __future__ import annotations

import abc
import contextlib
import inspect
from typing import Callable, ClassVar, ContextManager, Mapping

import attrs
import torch
from torch.export import ExportedProgram

from executorch.exir.backend.partitioner import DelegationSpec

from compiler.ir.dialect import op_name


@attrs.frozen
class KeepWhole:
    """Ops the backend wants kept whole (not decomposed) when going to Edge.

    `node_filter`, when set, narrows the request to the nodes it accepts, like
    the `check_op_support` function ExecuTorch partitioners return.
    """

    ops: frozenset[torch._ops.OpOverload] = frozenset()
    node_filter: Callable[[torch.fx.Node], bool] | None = None


@attrs.frozen
class BackendPartition:
    """What a backend's partition search decided for a program it tagged in place."""

    partitions: Mapping[str, DelegationSpec]
    # Node name -> why the backend left it on the CPU (nodes absent get a default reason).
    cpu_reasons: Mapping[str, str] = attrs.field(factory=dict)


class Backend(abc.ABC):
    """A compilation target: which ops it keeps whole, and what it takes."""

    name: ClassVar[str]
    # Dtypes this backend cannot take as a delegate input (Core ML: uint8, int8, ...).
    refused_input_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset()
    # Whether the partition search sees the constants decomposition computed folded (the float
    # mask SDPA's decomposition makes of a constant bool mask, with `where` on the CPU otherwise).
    folds_decomposed_constants: ClassVar[bool] = False

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The options this backend takes (by default, its constructor's keyword parameters;
        a backend that passes `**options` on to a partitioner names that partitioner's)."""
        parameters = inspect.signature(cls.__init__).parameters.values()
        return tuple(p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))

    def keep_whole(self, program: ExportedProgram) -> KeepWhole:
        return KeepWhole()

    def dry_run_needed(self, program: ExportedProgram, kept: list[torch.fx.Node]) -> str | None:
        """Why a node kept whole might still end up on the CPU (so the dry run must look),
        or None when the backend is sure to take every one of `kept`."""
        return f"the {self.name} backend may leave kept ops on the CPU"

    @abc.abstractmethod
    def partition(self, program: ExportedProgram) -> BackendPartition:
        """Tag the nodes this backend takes (node.meta['delegation_tag']) in place."""

    def default_cpu_reason(self, node: torch.fx.Node) -> str:
        return f"the {self.name} backend does not support {op_name(node.target)}"

    def lowering(self, dependency_checks: bool = False) -> ContextManager[None]:
        """Entered around `to_backend`: where a backend installs conversion fixes, and skips the
        checks its dependencies repeat after every step unless `dependency_checks`."""
        return contextlib.nullcontext()
