"""``python -m subclass_ca cache-key``: show this user's cache signing key, or rotate it (``--rotate``).

Rotation is the answer to a key others could read or write (Note [Trusting a compile cache] in
``trust.py``): a copy may exist, so the key is replaced, not re-permissioned, and the caches
signed with the old one must be saved again; the command says which.
"""

from __future__ import annotations

import argparse
import os

from ..errors import CacheFileError
from . import trust

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m subclass_ca cache-key",
        description="Show the key that signs this user's compile caches (save_cache, kept traces), or rotate it.",
    )
    parser.add_argument(
        "--rotate", action="store_true",
        help=f"replace the key file ({trust.KEY_FILE_ENV} or ~/.config/subclass_ca/cache-key) with a new random key, "
             "atomically and privately (0600 in a 0700 folder), and list the caches that must be saved again",
    )
    return parser


def _records_folder() -> str:
    from .traced import records_folder  # imports torch: only when rotating

    return records_folder()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.rotate:
            print(trust.rotate_key(_records_folder()).report())
            return 0
        if os.environ.get(trust.KEY_ENV):
            key = trust.resolve_key()
            print(f"{trust.KEY_ENV} is set: caches are signed with it (key id {trust.key_id(key)}); the key file "
                  f"{trust.key_file()} is not used.")
            return 0
        key = trust.resolve_key()
        print(f"cache signing key file: {trust.key_file()} (key id {trust.key_id(key)})")
        return 0
    except CacheFileError as error:
        print(f"subclass_ca: {error}")
        return 1
