"""Who wrote a compile cache: this user's signing key, signatures, and owner-checked cache folders.

Note [Trusting a compile cache]
-------------------------------
A compile cache is code.  The records subclass_ca keeps (Dynamo frames: bytecode, guards, a
bundled AOT entry) are unpickled and installed as the code of a CA graph, and torch's
mega-cache inside a :func:`~subclass_ca.save_cache` file is pickles that torch loads into its
caches.  A checksum guards against damage, not against an author (anyone can compute one), and
restricting what an unpickler may build would not help: once installed, a record *is* code.  So
nothing read from disk becomes code unless this user (or this job) wrote it:

* **Signed, and checked before anything is parsed.**  Every cache file and every kept-trace
  record carries an HMAC-SHA256 over all of its bytes (a record's over its name too, so a valid
  record cannot be moved to another graph's name) under a secret key.  :func:`load_cache` and the
  cache folder's reader check it first and refuse otherwise; nothing is unpickled before.
* **The key.**  ``key=`` where the API takes one; else ``SUBCLASS_CA_CACHE_KEY`` (the secret
  itself, at least 16 characters: a job spanning machines passes it to every rank as it would
  any secret); else this user's key file, ``SUBCLASS_CA_CACHE_KEY_FILE`` or
  ``$XDG_CONFIG_HOME/subclass_ca/cache-key`` (``~/.config``), created on first use with
  owner-only permissions (0600 in a 0700 folder) and refused, like an ssh key, when it belongs
  to someone else or others may read or write it.
* **Folders checked as git checks a repository** (``safe.directory``).  Kept-trace records are
  read from torch's cache folder only when that folder and ours inside it belong to this user
  and neither group nor others may write them; the record file likewise (opened without
  following a link).  Otherwise nothing there is read: the job compiles afresh, as stock does,
  and a warning says so once per folder, naming it and the fix.  A record in a good folder
  whose signature does not match (planted, or written under another key) is ignored with one
  warning per folder too.
* **The opt-in** for a file from someone else, ``load_cache(path, trust_unsigned_code=True)``,
  is named for what it does, like ``torch.load(weights_only=False)``: it loads a file whose
  signature is missing or does not match, and that file runs its code in this process.

What stays torch's: the entries torch itself writes to and reads from its cache folder (FX graph
and AOTAutograd caches) are read by torch as under stock; the folder warning above names the
folder so a user sees when it is not theirs.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
import warnings
from pathlib import Path

from ..errors import CacheFileError, UntrustedCacheWarning

__all__ = [
    "KEY_ENV",
    "KEY_FILE_ENV",
    "MIN_KEY_CHARS",
    "KeyUnavailable",
    "resolve_key",
    "key_file",
    "key_id",
    "sign",
    "verify",
    "folder_problem",
    "read_private_file",
    "write_private_file",
    "warn_once",
    "forget_warnings",
]

KEY_ENV = "SUBCLASS_CA_CACHE_KEY"
KEY_FILE_ENV = "SUBCLASS_CA_CACHE_KEY_FILE"
MIN_KEY_CHARS = 16
_warned: set[tuple[str, str]] = set()
_lock = threading.Lock()


class KeyUnavailable(CacheFileError):
    """No signing key: a bad ``key=`` or ``SUBCLASS_CA_CACHE_KEY``, or a key file that is not this user's alone."""


def _as_key(value: bytes | str, source: str) -> bytes:
    data = value.encode() if isinstance(value, str) else bytes(value)
    if len(data) < MIN_KEY_CHARS:
        raise KeyUnavailable(
            f"{source}: a cache signing key must be a secret of at least {MIN_KEY_CHARS} characters "
            f"(got {len(data)}); e.g. python -c 'import secrets; print(secrets.token_hex(32))'."
        )
    return data


def key_file() -> Path:
    """Where this user's default key lives (Note [Trusting a compile cache])."""
    explicit = os.environ.get(KEY_FILE_ENV)
    if explicit:
        return Path(explicit)
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "subclass_ca" / "cache-key"


def resolve_key(key: bytes | str | None = None) -> bytes:
    """The signing key: ``key``, else ``SUBCLASS_CA_CACHE_KEY``, else this user's key file (made on first use)."""
    if key is not None:
        return _as_key(key, "key=")
    from_env = os.environ.get(KEY_ENV)
    if from_env:
        return _as_key(from_env, KEY_ENV)
    path = key_file()
    data = read_private_file(path, what="cache signing key file")
    if data is None:
        data = _create_key_file(path)
    return _as_key(data.strip(), str(path))


def _create_key_file(path: Path) -> bytes:
    """A new random key at ``path`` (0600, folder 0700); a key another process made first wins."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fresh = secrets.token_hex(32).encode()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        write_private_file(tmp, fresh)
        try:
            os.link(tmp, path)  # atomic, and fails if a concurrent first use made one: every process ends on one key
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as error:
        raise KeyUnavailable(
            f"cannot create the cache signing key file {path} ({error}). Set {KEY_FILE_ENV} to a writable path of "
            f"your own, or pass the key itself in {KEY_ENV} or key=."
        ) from error
    data = read_private_file(path, what="cache signing key file")
    if data is None:
        raise KeyUnavailable(f"the cache signing key file {path} vanished while it was being created; run again.")
    return data


def key_id(key: bytes) -> str:
    """A short public name of a key, for messages that tell keys apart (reveals nothing of the key)."""
    return hmac.new(key, b"subclass_ca key id", hashlib.sha256).hexdigest()[:12]


def sign(key: bytes, purpose: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` (length-prefixed, so parts cannot be re-split) for one ``purpose``."""
    mac = hmac.new(key, purpose + b"\0", hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)
    return mac.digest()


def verify(key: bytes, signature: bytes, purpose: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(signature, sign(key, purpose, *parts))


def _mode_problem(status: os.stat_result, what: str, path: str | os.PathLike[str]) -> str | None:
    owner = getattr(os, "geteuid", None)
    if owner is not None and status.st_uid != owner():
        return f"{what} {os.fspath(path)} belongs to another user (uid {status.st_uid}, you are {owner()})"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} {os.fspath(path)} is writable by {'others' if status.st_mode & stat.S_IWOTH else 'its group'} (mode {stat.S_IMODE(status.st_mode):o})"
    return None


def folder_problem(*folders: str | os.PathLike[str]) -> str | None:
    """Why these folders cannot be trusted (another owner, writable by group or others); None: they can.

    A folder that does not exist is no problem (nothing can be read from it).
    """
    for folder in folders:
        try:
            status = os.stat(folder)
        except FileNotFoundError:
            continue
        problem = _mode_problem(status, "the folder", folder)
        if problem is not None:
            return problem
    return None


def read_private_file(path: str | os.PathLike[str], *, what: str) -> bytes | None:
    """The bytes of a file only this user may write (and, for a key, read); None if there is none.

    Opened without following a link and checked on the open file (no swap between check and
    read).  Raises :class:`KeyUnavailable` for a key file others may read, and
    :class:`CacheFileError` for any other file that is not this user's alone.
    """
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as error:  # ELOOP: a link where a file should be
        error_type = KeyUnavailable if "key" in what else CacheFileError
        raise error_type(f"{what} {os.fspath(path)} cannot be opened as a plain file of yours ({error}); replace it "
                         "with the file itself.") from error
    with os.fdopen(fd, "rb") as opened:
        status = os.fstat(opened.fileno())
        problem = _mode_problem(status, what, path)
        secret = "key" in what
        if problem is None and secret and status.st_mode & (stat.S_IRGRP | stat.S_IROTH):
            problem = f"{what} {os.fspath(path)} is readable by others (mode {stat.S_IMODE(status.st_mode):o})"
        if problem is not None:
            fix = f"chmod 600 {os.fspath(path)}" if secret else f"delete {os.fspath(path)}"
            error_type = KeyUnavailable if secret else CacheFileError
            raise error_type(f"{problem}: not used, since whoever can change it could run code in this job. Fix: {fix}.")
        return opened.read()


def write_private_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a new file readable and writable by this user only (fails if ``path`` exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def warn_once(topic: str, where: str, message: str) -> None:
    """One :class:`UntrustedCacheWarning` per (topic, folder) and process."""
    with _lock:
        if (topic, where) in _warned:
            return
        _warned.add((topic, where))
    warnings.warn(message, UntrustedCacheWarning, stacklevel=3)


def forget_warnings() -> None:
    """Warn again about folders already named (tests)."""
    with _lock:
        _warned.clear()
