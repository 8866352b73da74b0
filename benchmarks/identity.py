"""Byte identity: the `.pte` each model compiles to, before and after a change that must not change behaviour.

    python -m benchmarks.identity --write /tmp/before.json       # on the commit before
    python -m benchmarks.identity --against /tmp/before.json     # after: a table, and exit 1 on a difference

Each cell compiles a model (the built-in examples and some of the model suite) for a backend,
in float and with the backend's default quantization scheme, stage cache off, and records the
SHA-256 of the `.pte` (and of the `.ptd` where there is one). A refactoring that keeps every
cell the same has not changed what any stage does to these models.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
import warnings

BACKENDS = ("portable", "xnnpack", "coreml", "mlx")
MODELS = ("mlp", "convnet", "transformer", "shared_buffer", "llama_static_cache", "qwen3", "whisper", "gpt2:layers=4")
# Each backend's quantized cell: its most used scheme (portable: PT2E's dynamic int8).
SCHEMES = {"portable": "int8_dynamic", "xnnpack": "8da4w", "coreml": "4w", "mlx": "4w"}


def cells(models: list[str], backends: list[str]) -> list[tuple[str, str, str | None]]:
    return [(model, backend, scheme) for model in models for backend in backends
            for scheme in (None, SCHEMES[backend])]


def digest(model: str, backend: str, scheme: str | None) -> str:
    import torch

    import compiler
    from compiler.models.examples import resolve_model

    module, inputs, shapes = resolve_model(model)
    options = {"quantize": scheme} if scheme else {}
    try:
        with torch.no_grad():
            result = compiler.compile(module, inputs, backend, dynamic_shapes=shapes, cache=False, **options)
    except Exception as exc:  # a cell that fails must fail the same way after
        return f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return hashlib.sha256(result.pte).hexdigest()


def key(model: str, backend: str, scheme: str | None) -> str:
    return f"{model}/{backend}/{scheme or 'float'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE", help="record each cell's digest")
    mode.add_argument("--against", metavar="FILE", help="compare each cell with a recorded digest")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    recorded = {}
    if args.against:
        with open(args.against) as f:
            recorded = json.load(f)
    digests, differ = {}, 0
    print("| model | backend | scheme | .pte | seconds |\n|---|---|---|---|---|")
    for model, backend, scheme in cells(args.models, args.backends):
        start = time.perf_counter()
        name = key(model, backend, scheme)
        digests[name] = digest(model, backend, scheme)
        if args.against:
            before = recorded.get(name)
            verdict = "same" if before == digests[name] else "new cell" if before is None else "**different**"
            differ += verdict == "**different**"
        else:
            verdict = digests[name][:16]
        if digests[name].startswith("fails"):
            verdict += f" ({digests[name][:80]})"
        print(f"| {model} | {backend} | {scheme or 'float'} | {verdict} | {time.perf_counter() - start:.1f} |", flush=True)
    if args.write:
        with open(args.write, "w") as f:
            json.dump(digests, f, indent=1)
    else:
        print(f"\n{len(digests) - differ} of {len(digests)} cells byte-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
