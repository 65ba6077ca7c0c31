"""``python -m subclass_ca check``: certify registered and zoo subclasses (the testing kit's CLI); ``cache-key``.

The demo, the benchmarks, the FSDP2 runs, the support table and the GPU check are the
repository's tools, not part of the installed package: from a checkout, ``make demo`` /
``make bench`` / ... or ``python -m tools <command>`` (docs/design.md).
"""

from __future__ import annotations

import sys

#: Commands that moved out of the package into the repository's ``tools/`` (``python -m tools COMMAND``).
MOVED: tuple[str, ...] = ("demo", "bench", "fsdp2", "fsdp2-profile", "fsdp2-cost", "versions", "gpu-check")

USAGE = """usage: python -m subclass_ca {check,cache-key} [options]

  check      certify registered and zoo subclasses; print a table (python -m subclass_ca check --help)
  cache-key  show the key that signs this user's compile caches; --rotate replaces it and lists the
             caches to save again (python -m subclass_ca cache-key --help; docs/warm_start.md)

The demo, benchmarks, FSDP2 runs, support table and GPU check live in the repository, not in the
package: from a checkout, `make demo`, `make bench`, ... or `python -m tools --help`."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "check":
        from .testing import _cli

        return int(_cli.main(rest) or 0)
    if command == "cache-key":
        from ._warm_start import cli

        return cli.main(rest)
    if command in MOVED:
        print(f"subclass_ca: `python -m subclass_ca {command}` is no longer part of the installed package; from a "
              f"checkout of the repository run `python -m tools {command}` (or its make target, e.g. `make demo`).",
              file=sys.stderr)
        return 2
    print(f"subclass_ca: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
