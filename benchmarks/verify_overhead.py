"""Cost of the driver's machinery: verify-each on vs off, in one run.

Compiles the 12-block transformer example for XNNPACK alternately with and
without verification (no dumping), and prints the median ratio on/off, since
absolute times drift on a shared machine.

    python benchmarks/verify_overhead.py [--depth 12] [--repeats 3] [--backend xnnpack]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings

warnings.filterwarnings("ignore", category=FutureWarning)
logging.getLogger("torchao").setLevel(logging.ERROR)

import compiler  # noqa: E402
from compiler.models.examples import transformer  # noqa: E402


def time_compile(model, inputs, backend: str, verify: bool) -> tuple[float, float]:
    start = time.perf_counter()
    artifact = compiler.compile(model, inputs, backend, verify=verify)
    total = time.perf_counter() - start
    return total, sum(r.verify_seconds for r in artifact.report.stages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", default="xnnpack")
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()

    model, inputs = transformer(depth=args.depth)
    time_compile(model, inputs, args.backend, True)  # warm-up: imports, kernel registry
    on, off, verify_only = [], [], []
    for _ in range(args.repeats):
        total, verify_s = time_compile(model, inputs, args.backend, True)
        on.append(total)
        verify_only.append(verify_s)
        off.append(time_compile(model, inputs, args.backend, False)[0])
    result = {
        "depth": args.depth,
        "backend": args.backend,
        "verify_on_s": statistics.median(on),
        "verify_off_s": statistics.median(off),
        "verifier_time_s": statistics.median(verify_only),
        "ratio_on_off": statistics.median(on) / statistics.median(off),
    }
    print(f"transformer depth {args.depth}, backend {args.backend}, median of {args.repeats}")
    print(f"  verify on : {result['verify_on_s']:.2f} s (verifiers themselves {result['verifier_time_s']:.3f} s)")
    print(f"  verify off: {result['verify_off_s']:.2f} s")
    print(f"  ratio on/off: {result['ratio_on_off']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
