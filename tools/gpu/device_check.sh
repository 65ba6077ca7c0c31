#!/usr/bin/env bash
# The GPU check as the ONE command to run on the lent GPU device (docs/gpu.md):
#   device run, carry ["wheels"]:   bash tools/gpu/device_check.sh
# It uses that machine's own interpreter (python3: torch 2.11.0+cu130, pytest, xdist, tqdm, ...; GPU_PYTHON
# overrides it), subclass_ca and the tools from this checkout (nothing pip-installed from the network, nothing
# downloaded), and the wheels in wheels/ (make gpu-wheels, run where the network is), installed offline into
# build/gpu-check-site. Results go to $OUT (what the device returns: seven files at most), else gpu-check-out/.
# The budget (360 s by default) counts from this script's start. Extra arguments go to the check, e.g.
# --dry-run (no CUDA needed), --steps env,pytest-cuda, --budget-s 300.
set -euo pipefail
started=$(date +%s)
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
exec "${GPU_PYTHON:-python3}" -m tools gpu-check --out "${OUT:-gpu-check-out}" --budget-s "${GPU_BUDGET:-360}" \
  --wheels "${GPU_WHEELS:-wheels}" --started-at "$started" "$@"
