"""``python -m tools COMMAND [options]`` from the checkout's root: each command lives in its own module."""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("tools.demo.main", "train a small subclass model in four modes side by side"),
    "bench": ("tools.bench.main", "benchmark eager / compile / stock CA / subclass_ca"),
    "depth": ("tools.bench.depth", "cold start against depth (regional compiled autograd): compile-only vs stock CA vs subclass_ca"),
    "fsdp2": ("tools.fsdp2.parity", "FSDP2 (fully_shard) on N processes: each mode vs eager FSDP2 and a dense run"),
    "fsdp2-profile": ("tools.fsdp2.profiling", "FSDP2 backward under torch.profiler: where the reduce-scatters run, eager vs subclass_ca"),
    "fsdp2-cost": ("tools.fsdp2.cost", "FSDP2 backward time: compiled autograd itself vs compiling its pieces, against eager FSDP2"),
    "warm-start": ("tools.bench.warm_start", "the first step of a fresh process, cold and restarted, and where it goes"),
    "optimizer-in-backward": ("tools.bench.optimizer_in_backward", "optimizer-in-backward step time and peak memory: eager / compile-only / enable()"),
    "default-backend": ("tools.bench.default_backend", "a bare enable() on an inductor-compiled model vs compile-only"),
    "key-cost": ("tools.bench.key_cost", "what a behaviour key (Note [Keys by behaviour]) costs per CA graph and per forward"),
    "versions": ("tools.support.table", "support table: run one torch lane (run) or merge lanes (render)"),
    "torchao-matrix": ("tools.support.torchao_matrix", "the torchao certification matrix (docs/torchao.md) from check --json reports"),
    "gpu-check": ("tools.gpu.check", "verify the library on one CUDA GPU (tests, demo, bench, FSDP2); --dry-run without one"),
}
"""Command -> (module with ``main(argv)`` and ``build_parser()``, one line of help)."""


def usage() -> str:
    lines = ["usage: python -m tools {" + ",".join(COMMANDS) + "} [options]   (from the checkout's root)", ""]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:{width}s} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "The installed package's own command is `python -m subclass_ca check` (the testing kit)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"tools: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
