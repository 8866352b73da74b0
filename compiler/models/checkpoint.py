"""A `save_pretrained` folder as a model to compile, by task (optimum-executorch's task names).

The weights are read in the checkpoint's own dtype: a bfloat16 checkpoint stays bfloat16 (half
of float32's bytes), and the stages decide per weight what each backend computes in. Needs the
`models` extra (transformers).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch

from compiler.ir.errors import UserInputError
from compiler.models.catalog import TASKS
from compiler.process.memory import refuse_unless_it_fits

# Tokens in an encoder's example input, and the cache a text-generation step holds by default.
ENCODER_TOKENS = 16
DEFAULT_CACHE = 128


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A folder `save_pretrained` wrote: it holds config.json."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def checkpoint_dtype(folder: str | os.PathLike) -> torch.dtype:
    """The dtype the checkpoint's config names (float32 when it names none)."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def weight_bytes(folder: str | os.PathLike) -> int:
    """The bytes of the checkpoint's weight files (safetensors or bin)."""
    return sum(
        os.path.getsize(os.path.join(folder, name))
        for name in os.listdir(folder)
        if name.endswith((".safetensors", ".bin"))
    )


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise UserInputError(
            "a save_pretrained folder is read with Hugging Face transformers, which is not installed",
            hint="pip install -e '.[models]'",
        ) from exc
    return transformers


def _loaded(model_class: Any, folder: str) -> torch.nn.Module:
    """The model with its weights read once from the folder, in the checkpoint's dtype."""
    has_weights = any(name.endswith((".safetensors", ".bin")) for name in os.listdir(folder))
    if not has_weights:
        raise UserInputError(
            f"the folder {folder!r} holds a config but no weights (*.safetensors or *.bin)",
            hint="save the model with save_pretrained, which writes both",
        )
    from compiler.models.mapped_checkpoint import mapped_model

    config = _transformers().AutoConfig.from_pretrained(folder)
    dtype = checkpoint_dtype(folder)
    mapped = mapped_model(model_class, folder, config, dtype)
    return mapped if mapped is not None else read_whole(model_class, folder, dtype)


def read_whole(auto_class: Any, folder: str, dtype: torch.dtype, **kwargs: Any) -> torch.nn.Module:
    """The model with every weight read into memory (`from_pretrained`): for weights that cannot
    be mapped, refused first when the machine cannot hold them."""
    refuse_unless_it_fits(weight_bytes(folder), f"reading the checkpoint {folder!r} into memory")
    return auto_class.from_pretrained(folder, dtype=dtype, **kwargs).eval()


def _text_generation(folder: str, max_cache_len: int) -> tuple[torch.nn.Module, tuple, Any]:
    from compiler.models import llm

    text = llm.text_model(folder, max_cache_len=max_cache_len)
    text.reset()
    return text.step, text.example_inputs, text.dynamic_shapes


class _Encoder(torch.nn.Module):
    """The model's first output as a plain tensor (transformers returns a ModelOutput)."""

    def __init__(self, model: torch.nn.Module, output: str) -> None:
        super().__init__()
        self.model = model
        self.output = output

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return getattr(self.model(*inputs), self.output)


def _token_inputs(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = model.config.vocab_size
    tokens = torch.arange(ENCODER_TOKENS).remainder(vocab).unsqueeze(0)
    return tokens, torch.ones_like(tokens)


def _feature_extraction(folder: str, max_cache_len: int) -> tuple[torch.nn.Module, tuple, Any]:
    model = _loaded(_transformers().AutoModel, folder)
    return _Encoder(model, "last_hidden_state").eval(), _token_inputs(model), None


def _fill_mask(folder: str, max_cache_len: int) -> tuple[torch.nn.Module, tuple, Any]:
    model = _loaded(_transformers().AutoModelForMaskedLM, folder)
    return _Encoder(model, "logits").eval(), _token_inputs(model), None


def _image_classification(folder: str, max_cache_len: int) -> tuple[torch.nn.Module, tuple, Any]:
    model = _loaded(_transformers().AutoModelForImageClassification, folder)
    config = model.config
    size = getattr(config, "image_size", 224)
    size = size if isinstance(size, int) else size[0]
    dtype = checkpoint_dtype(folder)
    pixels = torch.randn(1, getattr(config, "num_channels", 3), size, size, generator=torch.Generator().manual_seed(0))
    return _Encoder(model, "logits").eval(), (pixels.to(dtype),), None


_LOADERS: dict[str, Callable[[str, int], tuple[torch.nn.Module, tuple, Any]]] = {
    "text-generation": _text_generation,
    "feature-extraction": _feature_extraction,
    "fill-mask": _fill_mask,
    "image-classification": _image_classification,
}


def load_checkpoint(
    folder: str | os.PathLike, task: str | None, max_cache_len: int = DEFAULT_CACHE
) -> tuple[torch.nn.Module, tuple, Any]:
    """(module, example inputs, dynamic shapes) of the folder's model for `task`; text-generation
    is the decoder step with its static KV cache of `max_cache_len` positions, as `generate` makes."""
    folder = os.fspath(folder)
    if not is_checkpoint(folder):
        raise UserInputError(
            f"{folder!r} is not a save_pretrained folder (no config.json)", hint="give the folder save_pretrained wrote"
        )
    if task is None:
        raise UserInputError(
            f"the checkpoint {folder!r} needs a task: what to compile of it",
            hint=f"give its task: one of {', '.join(TASKS)}",
        )
    if task not in _LOADERS:
        raise UserInputError(f"unknown task {task!r}", hint=f"give one of {', '.join(TASKS)}")
    _transformers()
    with torch.no_grad():
        return _LOADERS[task](folder, max_cache_len)
