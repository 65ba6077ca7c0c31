"""``python -m subclass_ca {demo,check,bench,fsdp2,fsdp2-profile,fsdp2-cost,versions,gpu-check}``: each subcommand lives in its own module."""

from __future__ import annotations

import importlib
import sys

_COMMANDS = {
    "demo": ("subclass_ca._tools.demo", "train a small subclass model in four modes side by side"),
    "check": ("subclass_ca.testing._cli", "certify registered and zoo subclasses; print a table"),
    "bench": ("subclass_ca._tools.bench", "benchmark eager / compile / stock CA / subclass_ca"),
    "fsdp2": ("subclass_ca._tools.fsdp2_parity", "FSDP2 (fully_shard) on N processes: each mode vs eager FSDP2 and a dense run"),
    "fsdp2-profile": ("subclass_ca._tools.fsdp2_profile", "FSDP2 backward under torch.profiler: where the reduce-scatters run, eager vs subclass_ca"),
    "fsdp2-cost": ("subclass_ca._tools.fsdp2_cost", "FSDP2 backward time: compiled autograd itself vs compiling its pieces, against eager FSDP2"),
    "versions": ("subclass_ca._tools.support_table", "support table: run one torch lane (run) or merge lanes (render)"),
    "gpu-check": ("subclass_ca._tools.gpu_check", "verify the library on one CUDA GPU (tests, demo, bench, FSDP2); --dry-run without one"),
}


def _usage() -> str:
    lines = ["usage: python -m subclass_ca {" + ",".join(_COMMANDS) + "} [options]", ""]
    width = max(map(len, _COMMANDS))
    lines += [f"  {name:{width}s} {help_text}" for name, (_, help_text) in _COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in _COMMANDS:
        print(f"subclass_ca: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(_COMMANDS[command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
