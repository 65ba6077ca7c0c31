"""Benchmark one training step: eager / torch.compile / stock compiled autograd / subclass_ca.

Thin entry point; the engine is ``tools/bench/main.py`` (same as ``python -m tools bench`` and
``make bench``), imported from this checkout.  Examples::

    python benchmarks/bench_step.py --quick --out-dir /tmp/bench
    python benchmarks/bench_step.py --threads 1          # full run, writes benchmarks/RESULTS.md
    python benchmarks/bench_step.py --device cuda
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: `tools` is not installed

from tools.bench.main import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
