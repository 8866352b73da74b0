"""The CompileError family: every failure a user can cause or meet, as a value.

Each error carries the stage it happened in, what went wrong, the nodes involved
and what to do next, so the CLI can render it once and tests can assert on it.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional


class CompileError(Exception):
    """Base of every error this package raises on purpose."""

    def __init__(
        self,
        reason: str,
        *,
        stage: Optional[str] = None,
        nodes: Iterable[str] = (),
        hint: Optional[str] = None,
        suggest: Mapping[str, Any] | None = None,
    ):
        self.reason = reason
        self.stage = stage
        self.nodes = tuple(nodes)
        self.hint = hint
        # Options that would get past this error, by their configuration names
        # (`backend`, `fold_skip_ops`, a backend option): each front end shows them in
        # its own terms (the CLI as flags, the API as keywords).
        self.suggest = dict(suggest or {})
        # Filled by the crash reproducer: where the failing stage's input was saved.
        self.reproducer_path: Optional[str] = None
        # Filled by the driver: what dependencies printed while the failing stage ran.
        self.dependency_messages: tuple[str, ...] = ()
        super().__init__(reason)

    def __str__(self) -> str:
        return self.render(_as_keywords, "compiler.compile(None, resume_from={path!r})")

    def render(self, show_options, resume: str) -> str:
        """The error as text; `show_options(mapping)` spells suggested options, `resume`
        (formatted with `path`) is how to continue from the saved stage input."""
        where = f"[{self.stage}] " if self.stage else ""
        lines = [f"{where}{self.reason}"]
        if self.nodes:
            shown = ", ".join(self.nodes[:10])
            more = f" (+{len(self.nodes) - 10} more)" if len(self.nodes) > 10 else ""
            lines.append(f"  nodes: {shown}{more}")
        if self.hint or self.suggest:
            shown = f" ({show_options(self.suggest)})" if self.suggest else ""
            lines.append(f"  what to do: {self.hint or 'set'}{shown}")
        if self.reproducer_path:
            lines.append(f"  the stage input was saved to {self.reproducer_path}")
            lines.append(f"  resume with: {resume.format(path=self.reproducer_path)}")
        return "\n".join(lines)


def _as_keywords(options: Mapping[str, Any]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in options.items())


class UserInputError(CompileError):
    """The model, inputs, options or files the user gave cannot be used."""


class CaptureError(CompileError):
    """torch.export could not capture the module."""


class PipelineError(CompileError):
    """A pipeline was asked for that cannot run (stages that do not chain)."""


class VerificationError(CompileError):
    """A program broke an invariant of its artifact type after a stage."""

    def __init__(self, invariant: str, reason: str, **kwargs):
        self.invariant = invariant
        super().__init__(f"invariant '{invariant}' violated: {reason}", **kwargs)


class StageFailure(CompileError):
    """A stage raised an unexpected exception; the original is chained."""


class ResumeError(CompileError):
    """A resume file is corrupt, from another version, or does not fit the pipeline."""


class UnsupportedOp(CompileError):
    """The model uses an op that no stage and no backend can compile (no decomposition, no kernel)."""


class UnsupportedByRuntime(CompileError):
    """The program cannot be run on this machine (e.g. a Core ML delegate)."""


class InsufficientMemory(CompileError):
    """The machine has not the memory the work needs: refused before it starts, not killed midway."""
