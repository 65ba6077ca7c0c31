"""Cost of entering and leaving the backward context: subclass_ca.enable() vs stock compiled autograd.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_enter_exit.py
Same run, interleaved rounds of 2000 enter+exit pairs, 200 warm-up pairs excluded; median and
spread over 7 rounds (µs per enter+exit).
"""

from __future__ import annotations

import statistics
import time

import torch

import subclass_ca
from subclass_ca import _compat

ROUNDS, PAIRS, WARMUP = 7, 2000, 200


def main() -> None:
    torch.set_num_threads(1)
    ours = subclass_ca.enable()
    stock_fn = _compat.stock_ca_compiler("aot_eager")
    contexts = {
        "stock compiled_autograd._enable": lambda: _compat.enable_compiled_autograd(stock_fn),
        "subclass_ca.enable()": lambda: ours,
    }
    for make in contexts.values():
        for _ in range(WARMUP):
            with make():
                pass
    samples: dict[str, list[float]] = {name: [] for name in contexts}
    for _ in range(ROUNDS):
        for name, make in contexts.items():
            start = time.perf_counter()
            for _ in range(PAIRS):
                with make():
                    pass
            samples[name].append((time.perf_counter() - start) / PAIRS * 1e6)
    stock = statistics.median(samples["stock compiled_autograd._enable"])
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"{name:34s} median {median:6.2f} us  (min {min(values):.2f}, max {max(values):.2f})  ratio {median / stock:.2f}x")


if __name__ == "__main__":
    main()
