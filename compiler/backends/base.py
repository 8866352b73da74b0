"""The interface every backend implements; stages talk only to this."""

from __future__ import annotations

import abc
import contextlib
import importlib
import inspect
from typing import Any, Callable, ClassVar, ContextManager, Mapping

import attrs
import torch
from torch.export import ExportedProgram

from executorch.exir.backend.partitioner import DelegationSpec

from compiler.ir import targets
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
    # What the report says of how the backend split the program (Core ML's pieces).
    notes: tuple[str, ...] = ()


class Backend(abc.ABC):
    """A compilation target: which ops it keeps whole, and what it takes."""

    name: ClassVar[str]
    # Dtypes this backend cannot take as a delegate input (Core ML: uint8, int8, ...).
    refused_input_dtypes: ClassVar[frozenset[torch.dtype]] = frozenset()
    # Whether the partition search sees the constants decomposition computed folded (the float
    # mask SDPA's decomposition makes of a constant bool mask, with `where` on the CPU otherwise).
    folds_decomposed_constants: ClassVar[bool] = False
    # Its refusal rules (a `compiler.backends.node_rules.RuleBook`; None: it has none), listed in the docs.
    refusal_rules: ClassVar[Any] = None
    # The LLM ops its runtime has kernels for (a `compiler.models.llm_ops.BackendOps`; None: none),
    # where they run, and why it has none: a generation program's decoder step calls them.
    llm_ops: ClassVar[Any] = None
    llm_ops_where: ClassVar[str] = "run by the runtime"
    no_llm_ops: ClassVar[str | None] = None

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

    # --- what the driver asks of a backend besides partitioning -----------------------------

    @classmethod
    def target(cls) -> targets.Target:
        """Its entry in the targets table: its data (names, schemes, options, memory factors)."""
        return targets.BY_NAME[cls.name]

    @classmethod
    def pt2e_quantizer(cls, scheme: Any, granularity: str) -> Any:
        """The PT2E quantizer for one of the PT2E schemes its target offers."""
        raise NotImplementedError(f"the {cls.name} backend takes no PT2E scheme")

    @classmethod
    def weight_only_config(cls, bits: int, group_size: int | None) -> Any | None:
        """Its own TorchAO config for a weight-only integer scheme (None: TorchAO's own)."""
        return None

    @classmethod
    def why_layer_stays_float(cls, scheme: Any, columns: int, one_dimensional_input: bool) -> str | None:
        """Why its kernels cannot take a Linear of `columns` input features quantized by
        `scheme` (None: they can), so the layer stays in float with this reason."""
        return None

    @classmethod
    def float32_options(cls) -> Mapping[str, Any] | None:
        """The options that make it compute in float32 where it would compute in a lower
        precision by default (None: it computes in each node's own dtype)."""
        return None

    @classmethod
    def share_method_weights(cls, lowered: Mapping[str, Any]) -> Mapping[str, Any]:
        """The methods' lowered programs with the weights they share held once (by default, as given)."""
        return lowered

    @classmethod
    def stock_partitioners(cls, options: Mapping[str, Any] | None = None) -> list:
        """Stock ExecuTorch's partitioners for it, built with `options`: the stock path beside ours."""
        where = cls.target().stock_partitioner
        if where is None:
            return []
        module_name, class_name = where.split(":")
        return [getattr(importlib.import_module(module_name), class_name)(**dict(options or {}))]
