"""Built-in example models: small, random weights, built in code.

Each factory returns `(module, example_inputs)`; keyword arguments (from the
CLI as `name:key=value,...`) change their size.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import importlib.util
import inspect
from typing import Any, Callable, Iterator

import torch
from torch import nn

from compiler.models import model_suite
from compiler.models.catalog import check_model_spec, is_checkpoint_spec
from compiler.models.checkpoint import load_checkpoint
from compiler.ir.errors import CompileError, UserInputError


class MLP(nn.Module):
    def __init__(self, features: int = 32, hidden: int = 64, layers: int = 3) -> None:
        super().__init__()
        dims = [features] + [hidden] * (layers - 1) + [features]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)


class ConvNet(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(channels, channels * 2, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(channels * 2, classes)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, qkv Linear, SDPA, out Linear, GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, depth: int = 2, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(self.blocks(x))


class SharedBuffer(nn.Module):
    """Reads one registered buffer in ops a delegate takes and in ops that stay on the CPU."""

    def __init__(self, features: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(features, features)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, features))

    def forward(self, x):
        y = self.proj(x) * self.scale  # a delegate takes the mul
        return torch.cumsum(y, dim=-1) + torch.atan2(x, self.scale)  # cumsum, atan2 stay on the CPU


def _seeded(factory: Callable) -> Callable:
    """Same weights and inputs on every call, so a resumed run can be checked against eager;
    `seed` draws others (calibration inputs are the inputs of draws 1..N)."""

    @functools.wraps(factory)
    def make(*args, seed: int = 0, **kwargs):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return factory(*args, **kwargs)

    make.draws_inputs = True
    return make


@_seeded
def mlp(features: int = 32, hidden: int = 64, layers: int = 3, batch: int = 4):
    """MLP of Linear + ReLU layers."""
    return MLP(features, hidden, layers).eval(), (torch.randn(batch, features),)


@_seeded
def convnet(channels: int = 8, size: int = 32, batch: int = 1):
    """Small conv net: Conv2d, BatchNorm, ReLU, MaxPool, AdaptiveAvgPool, Linear."""
    return ConvNet(channels).eval(), (torch.randn(batch, 3, size, size),)


@_seeded
def transformer(depth: int = 2, dim: int = 64, heads: int = 4, seq: int = 16, batch: int = 1):
    """Pre-norm transformer block stack (LayerNorm, qkv Linear, SDPA, out Linear, GELU MLP)."""
    return Transformer(depth, dim, heads).eval(), (torch.randn(batch, seq, dim),)


@_seeded
def shared_buffer(features: int = 16, batch: int = 2):
    """A registered buffer read both by delegated ops and by ops on the CPU."""
    return SharedBuffer(features).eval(), (torch.randn(batch, features),)


EXAMPLES: dict[str, Callable] = {
    "mlp": mlp,
    "convnet": convnet,
    "transformer": transformer,
    "shared_buffer": shared_buffer,
}

# Every model a MODEL spec can name: the built-in examples and the transformers model
# suite (which needs the models extra).
MODELS: dict[str, Callable] = {**EXAMPLES, **model_suite.SUITE}


def _factory(spec: str) -> tuple[Callable, dict[str, Any]]:
    check_model_spec(spec)
    head, _, tail = spec.partition(":")
    if head in MODELS:
        return MODELS[head], _parse_kwargs(tail, spec)
    if is_checkpoint_spec(spec):
        return functools.partial(load_checkpoint, head, tail), {}
    return _factory_from_file(head, tail), {}


def resolve_model(spec: str) -> tuple[nn.Module, tuple, Any]:
    """`name[:key=value,...]` for a built-in example, `path/to/file.py:factory`, or `FOLDER:TASK` for a
    `save_pretrained` folder (`compiler.models.checkpoint`).

    A factory returns `(module, example_inputs)` or `(module, example_inputs, dynamic_shapes)`.
    """
    factory, kwargs = _factory(spec)
    return _made(spec, factory, kwargs)


def draw_inputs(spec: str, count: int) -> tuple[tuple, ...]:
    """`count` input tuples for calibration: the example inputs of the factory's draws 1..count.
    A factory with a `seed` keyword is given the draw's number (the built-in models take one);
    any other is called with torch's, numpy's and Python's global generators seeded to it, as
    users write factories (`torch.randn(...)` inside), their states restored after. Draws that
    repeat the same inputs are an error: calibration would see one input many times."""
    factory, kwargs = _factory(spec)
    takes_seed = getattr(factory, "draws_inputs", False) or "seed" in inspect.signature(factory).parameters
    drawn: list[tuple] = []
    seen: dict[bytes, int] = {}
    for seed in range(1, count + 1):
        if takes_seed:
            inputs = tuple(_made(spec, factory, {**kwargs, "seed": seed})[1])
        else:
            with _global_generators_seeded(seed):
                inputs = tuple(_made(spec, factory, kwargs)[1])
        digest = _inputs_digest(inputs)
        if digest in seen:
            how = "its `seed` keyword" if takes_seed else "the global generators seeded"
            raise UserInputError(
                f"the model factory for {spec!r} gave the same inputs for draws {seen[digest]} and {seed} "
                f"(called with {how}): calibration would see one input",
                stage="quantize",
                hint="make the factory draw its inputs from torch's generator (torch.randn, torch.rand) or "
                "from its `seed` keyword, or pass --calibration FILE (a torch.save'd list of input tuples)",
            )
        seen[digest] = seed
        drawn.append(inputs)
    return tuple(drawn)


@contextlib.contextmanager
def _global_generators_seeded(seed: int) -> Iterator[None]:
    import random

    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _inputs_digest(inputs: tuple) -> bytes:
    """A digest of the input tensors' values (and of any other input's repr)."""
    digest = hashlib.sha256()
    for leaf in torch.utils._pytree.tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor):
            tensor = leaf.detach().contiguous().cpu()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        else:
            digest.update(repr(leaf).encode())
    return digest.digest()


def _made(spec: str, factory: Callable, kwargs: dict[str, Any]) -> tuple[nn.Module, tuple, Any]:
    try:
        made = factory(**kwargs)
    except CompileError:  # the factory's own named error says what to do; no advice of ours on top
        raise
    except Exception as exc:
        raise UserInputError(
            f"the model factory for {spec!r} failed: {type(exc).__name__}: {exc}", hint=_factory_hint(factory, exc),
        ) from exc
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise UserInputError(
            f"the model factory for {spec!r} returned {type(made).__name__}",
            hint="return (module, example_inputs) or (module, example_inputs, dynamic_shapes)",
        )
    module, inputs, *rest = made
    return module, inputs, rest[0] if rest else None


def _factory_hint(factory: Callable, error: Exception) -> str:
    """The advice that applies: a factory called with keywords it does not take names those it does."""
    if isinstance(error, TypeError) and "keyword argument" in str(error):
        try:
            takes = [name for name in inspect.signature(factory).parameters if name != "seed"]
        except (TypeError, ValueError):
            takes = []
        return f"it takes {', '.join(takes)}" if takes else "it takes no keywords"
    return "run the factory on its own to see where it fails"


def _parse_kwargs(text: str, spec: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for item in filter(None, text.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise UserInputError(f"cannot read {item!r} in MODEL {spec!r}", hint="write name:key=value,key=value")
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = value.strip()
    return kwargs


def _factory_from_file(path: str, name: str) -> Callable:
    module_spec = importlib.util.spec_from_file_location(f"_compiler_model_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise UserInputError(
            f"importing {path!r} failed: {type(exc).__name__}: {exc}",
            hint="run the file with python to see the error",
        ) from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise UserInputError(
            f"{path!r} has no function {name!r}",
            hint=f"functions there: {', '.join(n for n, v in vars(module).items() if inspect.isfunction(v))}",
        )
    return factory
