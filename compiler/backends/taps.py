"""What a backend's `intermediate_values` hook returns (see `compiler.backends.INTERMEDIATE_VALUES`):
the values of the Edge nodes a delegate payload computes, by node name, and the payload ops that
compute each. Torch-free, like `compiler.backends` itself."""

from __future__ import annotations

from typing import Any, Iterable, Mapping


class PayloadValues(dict):
    """Edge node name -> that node's value as the payload computes it (a torch tensor; see
    `node_value` for its dtype and shape). `ops`: node name -> the payload op(s) that compute it,
    as a person reads them ("gelu (mode EXACT)"). A plain dict to callers that want only the values."""

    def __init__(self, values: Mapping[str, Any] | Iterable = (), ops: Mapping[str, str] | None = None) -> None:
        super().__init__(values)
        self.ops: dict[str, str] = dict(ops or {})


def describe_op(kind: str, attributes: Mapping[str, Any]) -> str:
    """`kind (name value, ...)`: an op and the attributes that say what it does."""
    shown = ", ".join(f"{name} {_show(value)}" for name, value in attributes.items())
    return f"{kind} ({shown})" if shown else kind


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


def _kind(dtype: Any) -> str:
    return "bool" if str(dtype) == "torch.bool" else "float" if dtype.is_floating_point or dtype.is_complex else "int"


def node_value(value: Any, want: Any) -> Any:
    """A payload's value (a torch tensor) as the value of the node whose `meta["val"]` is `want`:
    in the node's shape where the payload's differs only in layout (Core ML has no 0-d tensors)
    and the node's is static; in the node's dtype where the payload computes the same kind of
    number (float16 for float32, int32 for int64), and in its own where it computes another kind
    (a float where torch gives an integer): cast, its numbers would hide that very fault."""
    shape = tuple(want.shape)
    if all(isinstance(d, int) for d in shape) and tuple(value.shape) != shape and value.numel() == want.numel():
        value = value.reshape(shape)
    return value.to(want.dtype) if _kind(value.dtype) == _kind(want.dtype) else value
