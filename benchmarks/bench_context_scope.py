"""Per-step cost of entering subclass_ca.enable() around every step vs once around the loop.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_context_scope.py
Same-run, interleaved, warm-up excluded; prints the best of 3 rounds of 300 steps (µs/step).
"""

from __future__ import annotations

import time

import torch

import subclass_ca
from subclass_ca import _compat


def main() -> None:
    torch.set_num_threads(1)
    x = torch.randn(8, 32)

    def model():
        w = torch.nn.Parameter(torch.randn(32, 32))
        return torch.compile(lambda x: (x @ w).tanh().sum(), backend="aot_eager")

    stock_step, our_step = model(), model()  # separate compiled forwards: separate CA graphs

    def stock_ctx():
        return _compat.enable_compiled_autograd(_compat.stock_ca_compiler("aot_eager"))

    ours = subclass_ca.enable()
    per_step = {
        "stock CA, entered per step": lambda: _once(stock_ctx(), stock_step, x),
        "subclass_ca, entered per step": lambda: _once(ours, our_step, x),
    }
    for run in per_step.values():
        for _ in range(5):
            run()
    results: dict[str, list[float]] = {}
    for _ in range(3):
        for name, run in per_step.items():
            start = time.perf_counter()
            for _ in range(300):
                run()
            results.setdefault(name, []).append((time.perf_counter() - start) / 300 * 1e6)
        for name, ctx, step in (("stock CA, entered once", stock_ctx(), stock_step), ("subclass_ca, entered once", ours, our_step)):
            with ctx:
                start = time.perf_counter()
                for _ in range(300):
                    step(x).backward()
                results.setdefault(name, []).append((time.perf_counter() - start) / 300 * 1e6)
    for name, samples in results.items():
        print(f"{name:32s} {min(samples):7.1f} us/step  (rounds: {', '.join(f'{s:.1f}' for s in samples)})")


def _once(ctx, step, x):
    with ctx:
        step(x).backward()


if __name__ == "__main__":
    main()
