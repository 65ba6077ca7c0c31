"""What the trust tests plant: a pickle that leaves a marker file when anything unpickles it, and files that carry it."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

from subclass_ca._warm_start import files as cache

OTHER_KEY = b"another user's key, 32 bytes...."


class Payload:
    """Unpickling it creates ``marker``: what an attacker's pickle would do with a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def payload_file(marker: Path, signing_key: bytes | None) -> bytes:
    """A cache file whose records run code when unpickled: signed with ``signing_key``, or laid out as issue 52's crafted file."""
    payload = pickle.dumps({"k": Payload(marker)})
    header = {**cache._header(), "artifact_bytes": 0, "sha256": hashlib.sha256(payload).hexdigest()}
    if signing_key is None:  # issue 52's recipe: a valid header and checksum, no signature
        return cache._MAGIC + json.dumps(header).encode() + b"\n" + payload
    return cache._encode(signing_key, header, payload)


def records_file(signing_key: bytes | None, records: dict[str, bytes], *, artifacts: bytes = b"artifacts",
                 header: dict | None = None) -> bytes:
    """A cache file holding ``records`` (kept traces by graph key): signed with ``signing_key``, or unsigned (None)."""
    payload = artifacts + pickle.dumps(records)
    full = {**cache._header(), "artifact_bytes": len(artifacts), "sha256": hashlib.sha256(payload).hexdigest(), **(header or {})}
    if signing_key is None:
        return cache._MAGIC + json.dumps(full).encode() + b"\n" + payload
    return cache._encode(signing_key, full, payload)
