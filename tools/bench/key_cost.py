"""What a behaviour key costs (Note [Keys by behaviour]): per CA graph capture and per subclass-input forward.

``python -m tools key-cost [--repeats N] [--out FILE]``: captures the CA graph of a TwoTensor MLP
(and of an NF4-LoRA block where torchao is installed) with ``capture_with``, then times
``behaviour_key`` on it and on the forward's Dynamo graph, warm-up excluded, and prints median
[min, max] in µs beside the step it is added to (the warm first backward, measured in the same run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools key-cost", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", help="append the table to this Markdown file")
    return parser


def _timed(fn: Any, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return times


def _mlp(depth: int) -> tuple[Any, Any]:
    from subclass_ca import _compat

    two_tensor = _compat.two_tensor_type()
    assert two_tensor is not None, "this torch has no TwoTensor"
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(two_tensor(torch.randn(64, 64), torch.randn(64, 64))) for _ in range(depth)]

    def loss(x):
        for w in weights:
            x = (x @ w).tanh()
        return x.sum()

    return loss, torch.randn(8, 64)


def _measure(depth: int, repeats: int) -> tuple[str, int, list[float], list[float], float]:
    """(graph, CA graph nodes, CA graph key µs, forward key µs, first backward µs) for a ``depth``-layer MLP."""
    from subclass_ca._runtime import capture_with
    from subclass_ca._warm_start.keys import behaviour_key

    loss, x = _mlp(depth)
    graphs: list[Any] = []

    def keep(gm: Any) -> Any:
        def run(*call_args: Any) -> Any:
            graphs.append((gm, [list(a) if isinstance(a, list) else a for a in call_args]))
            return gm(*call_args)
        return run

    forwards: list[Any] = []

    def forward_backend(gm: Any, example_inputs: Any) -> Any:
        forwards.append((gm, list(example_inputs)))
        from torch._dynamo.backends.common import aot_autograd
        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    step = torch.compile(loss, backend=forward_backend)
    with capture_with(keep):
        start = time.perf_counter()
        step(x).backward()
        first = (time.perf_counter() - start) * 1e6
    gm, call_args = graphs[0]
    ca = _timed(lambda: behaviour_key(gm, call_args), repeats)
    fw_gm, fw_inputs = forwards[0]
    fw = _timed(lambda: behaviour_key(fw_gm, fw_inputs), repeats)
    return f"TwoTensor MLP, {depth} layers", len(gm.graph.nodes), ca, fw, first


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    rows = [_measure(depth, args.repeats) for depth in (2, 8)]
    lines = [
        "| graph | CA graph nodes | CA graph key, µs median [min, max] | forward key, µs median [min, max] | first backward (aot_eager, cold), µs |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, nodes, ca, fw, first in rows:
        lines.append(
            f"| {name} | {nodes} | {statistics.median(ca):.0f} [{min(ca):.0f}, {max(ca):.0f}] | "
            f"{statistics.median(fw):.0f} [{min(fw):.0f}, {max(fw):.0f}] | {first:.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
