"""Who wrote a compile cache: this user's signing key, signatures, owner-checked folders, and safe file access.

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
* **The key.**  ``signing_key=`` where the API takes one; else ``SUBCLASS_CA_CACHE_KEY`` (the secret
  itself: a job spanning machines passes it to every rank as it would any secret); else this
  user's key file, ``SUBCLASS_CA_CACHE_KEY_FILE`` or ``$XDG_CONFIG_HOME/subclass_ca/cache-key``
  (``~/.config``), created on first use with owner-only permissions (0600 in a 0700 folder).  A key
  is a secret of at least 128 bits: 16 bytes given as bytes, 32 characters given as text (the hex
  of 16 bytes).  A key file, or its folder, that is a link, belongs to someone else or that others
  may read or write is refused like an ssh key; since a copy may exist, the advice is to rotate it
  (``python -m subclass_ca cache-key --rotate``: a new key, and the caches to save again), never
  to tighten the mode of a key others may already hold.
* **Folders checked as git checks a repository** (``safe.directory``).  Kept-trace records are
  read from torch's cache folder only when that folder and ours inside it belong to this user
  and neither group nor others may write them.  Otherwise nothing there is read: the job
  compiles afresh, as stock does, and a warning says so once per folder, naming it and the fix.
  A record in a good folder whose signature does not match (planted, or written under another
  key) is ignored with one warning per folder too.
* **Only regular files are read, and every write is private.**  Every file subclass_ca reads
  back (a cache file, a record, the key) is opened without following a link and without
  blocking (a FIFO would otherwise hang the job) and checked on the open descriptor to be a
  regular file (:func:`read_regular_file`): anything else is refused with
  :class:`CacheFileError`, or the one warning where the job goes on without it.  Every file it
  writes goes through :func:`write_private_file`: a new, randomly named file beside the target
  (``O_CREAT|O_EXCL|O_NOFOLLOW``, 0600), renamed over it once complete, removed on failure, so a
  link planted at a predictable name is never followed and a reader never sees half a file.
* **The opt-in** for a file from someone else, ``load_cache(path, trust_unsigned_code=True)``,
  is named for what it does, like ``torch.load(weights_only=False)``: it loads a file whose
  signature is missing or does not match, and that file runs its code in this process.  It ends
  with its call: what it loaded is used by this process only and never signed again.  A record
  is signed (into the cache folder by ``save_cache()``, into a file by ``save_cache(path)``) only
  when this process compiled it, or it came from a file whose signature verified under the very
  key that signs (``traced.Record.may_sign``).

What stays torch's: the entries torch itself writes to and reads from its cache folder (FX graph
and AOTAutograd caches) are read by torch as under stock; the folder warning above names the
folder so a user sees when it is not theirs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import os
import secrets
import stat
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

from ..errors import CacheFileError, UntrustedCacheWarning

__all__ = [
    "KEY_ENV",
    "KEY_FILE_ENV",
    "MIN_KEY_BYTES",
    "MIN_KEY_TEXT",
    "ROTATE_COMMAND",
    "KeyUnavailable",
    "Rotation",
    "resolve_key",
    "rotate_key",
    "key_file",
    "key_id",
    "sign",
    "verify",
    "folder_problem",
    "read_regular_file",
    "read_private_file",
    "write_private_file",
    "warn_once",
    "forget_warnings",
]

KEY_ENV = "SUBCLASS_CA_CACHE_KEY"
KEY_FILE_ENV = "SUBCLASS_CA_CACHE_KEY_FILE"
MIN_KEY_BYTES = 16
"""128 bits: the shortest key given as bytes (``signing_key=b"..."``)."""
MIN_KEY_TEXT = 32
"""The shortest key given as text (``signing_key="..."``, ``SUBCLASS_CA_CACHE_KEY``, the key file): 16 bytes in hex."""
ROTATE_COMMAND = "python -m subclass_ca cache-key --rotate"
_GENERATE = "python -c \"import secrets; print(secrets.token_hex(32))\""
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_warned: set[tuple[str, str]] = set()
_lock = threading.Lock()


class KeyUnavailable(CacheFileError):
    """No signing key: a bad ``signing_key=`` or ``SUBCLASS_CA_CACHE_KEY``, or a key file (or folder) that is not this user's alone."""


def _as_key(value: bytes | str, source: str, *, text: bool) -> bytes:
    data = value.encode() if isinstance(value, str) else bytes(value)
    needed, unit = (MIN_KEY_TEXT, "characters") if text else (MIN_KEY_BYTES, "bytes")
    if len(data) < needed:
        raise KeyUnavailable(
            f"{source}: a cache signing key must be a secret of at least 128 bits: {MIN_KEY_BYTES} random bytes, or "
            f"{MIN_KEY_TEXT} hex characters as text (got {len(data)} {unit}). Generate one with {_GENERATE}."
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
        return _as_key(key, "signing_key=", text=isinstance(key, str))
    from_env = os.environ.get(KEY_ENV)
    if from_env:
        return _as_key(from_env, KEY_ENV, text=True)
    path = key_file()
    data = _read_key_file(path)
    if data is None:
        data = _create_key_file(path)
    return _as_key(data.strip(), str(path), text=True)


def _rotate_advice(path: Path) -> str:
    where = f" (with {KEY_FILE_ENV}={path} set, as here)" if os.environ.get(KEY_FILE_ENV) else ""
    return (f"Someone may hold a copy, so do not just tighten its mode: rotate the key with {ROTATE_COMMAND}{where}, "
            "which makes a new private key and names the caches to save again")


@contextlib.contextmanager
def _key_folder(path: Path, *, create: bool) -> Iterator[int | None]:
    """The key file's folder, opened without following a link and checked to be this user's alone; None: none."""
    folder = path.parent
    if create:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as error:
            raise KeyUnavailable(
                f"cannot create the cache signing key folder {folder} ({error}). Set {KEY_FILE_ENV} to a path in a "
                f"folder of your own, or pass the key itself in {KEY_ENV} or signing_key=."
            ) from error
    try:
        fd: int | None = os.open(folder, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except FileNotFoundError:
        fd = None
    except OSError as error:  # ELOOP / ENOTDIR: a link, or not a folder
        raise KeyUnavailable(
            f"the cache signing key folder {folder} is a link or not a folder ({error}): not used, since whoever "
            f"controls where it points controls the key. Use a real folder of your own ({KEY_FILE_ENV}=...). "
            f"{_rotate_advice(path)}."
        ) from error
    if fd is None:
        yield None
        return
    try:
        problem = _mode_problem(os.fstat(fd), "the cache signing key folder", folder)
        if problem is not None:
            raise KeyUnavailable(
                f"{problem}: the key in it is not used, since whoever can change the folder can swap the key. Make the "
                f"folder yours alone (chmod 700 {folder}) or set {KEY_FILE_ENV} to a file in a folder of your own. "
                f"{_rotate_advice(path)}."
            )
        yield fd
    finally:
        os.close(fd)


def _read_key_file(path: Path) -> bytes | None:
    with _key_folder(path, create=False) as folder_fd:
        if folder_fd is None:
            return None
        return read_private_file(path, what="cache signing key file", dir_fd=folder_fd)


def _create_key_file(path: Path) -> bytes:
    """A new random key at ``path`` (0600, folder 0700); a key another process made first wins."""
    with _key_folder(path, create=True):
        try:
            write_private_file(path, secrets.token_hex(32).encode(), overwrite=False)
        except OSError as error:
            raise KeyUnavailable(
                f"cannot create the cache signing key file {path} ({error}). Set {KEY_FILE_ENV} to a writable path of "
                f"your own, or pass the key itself in {KEY_ENV} or signing_key=."
            ) from error
    data = _read_key_file(path)
    if data is None:
        raise KeyUnavailable(f"the cache signing key file {path} vanished while it was being created; run again.")
    return data


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rotation:
    """What :func:`rotate_key` did, and what it made stale."""

    path: str
    """The key file now holding the new key."""
    new_key_id: str
    old_key_id: str | None
    """The replaced key's id (None: there was none, or it could not be read)."""
    stale_records: int
    """Kept traces in this process's cache folder (``records_folder``), signed with the old key: read again only once re-saved."""
    records_folder: str
    env_key_set: bool
    """``SUBCLASS_CA_CACHE_KEY`` is set: processes with it sign with that secret, not with the key file."""

    def report(self) -> str:
        """What to tell the user: the new key, and which caches must be saved again."""
        old = f"key id {self.old_key_id}" if self.old_key_id else "the old key"
        lines = [
            f"subclass_ca: a new cache signing key is in {self.path} (key id {self.new_key_id}); {old} signs nothing any more.",
            "Save these caches again (each is refused or ignored until then, and the job compiles afresh):",
            f"  * every file save_cache(path) wrote with {old}: load_cache() refuses it (\"signed with another key\"); "
            "call save_cache(path) again after the next run's first steps;",
            f"  * the kept traces in {self.records_folder} ({self.stale_records} now): ignored with one warning until "
            f"save_cache() writes them again (or delete them: rm -r {self.records_folder}).",
        ]
        if self.env_key_set:
            lines.append(f"Note: {KEY_ENV} is set here: processes that see it sign with that secret, not with the key "
                         "file; rotate that secret where you keep it.")
        return "\n".join(lines)


def rotate_key(records_folder: str | os.PathLike[str]) -> Rotation:
    """Replace this user's key file with a new random key, atomically; ``records_folder``: where kept traces live.

    The folder must be this user's alone (it is created 0700 if missing); a key file others could
    read is replaced all the same (that is the point).
    """
    path = key_file()
    with _key_folder(path, create=True) as folder_fd:
        old = _read_any(path, folder_fd)
        fresh = secrets.token_hex(32).encode()
        try:
            write_private_file(path, fresh)
        except OSError as error:
            raise KeyUnavailable(f"cannot replace the cache signing key file {path} ({error}); remove it, then run "
                                 f"{ROTATE_COMMAND} again.") from error
    try:
        stale = sum(1 for entry in os.scandir(records_folder) if entry.is_file(follow_symlinks=False))
    except OSError:
        stale = 0
    return Rotation(path=str(path), new_key_id=key_id(fresh), old_key_id=None if old is None else key_id(old),
                    stale_records=stale, records_folder=os.fspath(records_folder), env_key_set=bool(os.environ.get(KEY_ENV)))


def _read_any(path: Path, folder_fd: int | None) -> bytes | None:
    """The old key's bytes for its id, whoever may read it (None when it is not a readable regular file)."""
    try:
        data = read_regular_file(path, what="cache signing key file", dir_fd=folder_fd)
    except CacheFileError:
        return None
    stripped = None if data is None else data.strip()
    return stripped or None


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


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _error_type(what: str) -> type[CacheFileError]:
    return KeyUnavailable if "key" in what else CacheFileError


def _open_regular(path: str | os.PathLike[str], what: str, dir_fd: int | None) -> tuple[int, os.stat_result] | None:
    """An fd of ``path`` opened without following a link or blocking, and its ``fstat``: a regular file, or refused.

    None: there is no such file.  ``dir_fd``: the folder ``path``'s name is looked up in (its last component).
    """
    name = os.path.basename(os.fspath(path)) if dir_fd is not None else path
    try:
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as error:  # ELOOP: a link where a file should be; EACCES, ENXIO, ...
        raise _error_type(what)(
            f"{what} {os.fspath(path)} cannot be opened as a plain file of yours ({error}): refused without reading "
            "it. Replace it with the file itself."
        ) from error
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        os.close(fd)
        raise _error_type(what)(
            f"{what} {os.fspath(path)} is {_kind(status.st_mode)}, not a regular file: refused without reading it "
            f"(a read could block forever or fail). Remove it, or point to the file itself."
        )
    return fd, status


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as opened:
        os.set_blocking(opened.fileno(), True)  # a regular file: reads never block; clear O_NONBLOCK anyway
        return opened.read()


def read_regular_file(path: str | os.PathLike[str], *, what: str, dir_fd: int | None = None) -> bytes | None:
    """The bytes of ``path`` if it is a regular file; None if there is none; :class:`CacheFileError` otherwise.

    Opened without following a link and without blocking (a FIFO never hangs the reader), then
    checked on the open file (``fstat``), so nothing can be swapped in between the check and the read.
    """
    opened = _open_regular(path, what, dir_fd)
    return None if opened is None else _read_all(opened[0])


def read_private_file(path: str | os.PathLike[str], *, what: str, dir_fd: int | None = None) -> bytes | None:
    """The bytes of a regular file only this user may write (and, for a key, read); None if there is none.

    As :func:`read_regular_file`, and refused unless it is this user's alone: :class:`KeyUnavailable`
    for a key file, with the advice to rotate the key; :class:`CacheFileError` for any other file.
    """
    opened = _open_regular(path, what, dir_fd)
    if opened is None:
        return None
    fd, status = opened
    secret = "key" in what
    problem = _mode_problem(status, what, path)
    if problem is None and secret and status.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        problem = f"{what} {os.fspath(path)} is readable by {'others' if status.st_mode & stat.S_IROTH else 'its group'} (mode {stat.S_IMODE(status.st_mode):o})"
    if problem is not None:
        os.close(fd)
        if secret:
            raise KeyUnavailable(f"{problem}: not used, since whoever could read it could sign code this job runs, and "
                                 f"whoever could write it could swap it. {_rotate_advice(Path(path))}.")
        raise CacheFileError(f"{problem}: not used, since whoever can change it could run code in this job. Fix: "
                             f"delete {os.fspath(path)}.")
    return _read_all(fd)


def write_private_file(path: str | os.PathLike[str], data: bytes, *, overwrite: bool = True) -> bool:
    """Write ``data`` to ``path`` privately and atomically: the one way subclass_ca writes a file.

    A new file with a random name beside ``path`` (``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600: a link
    or file planted at that name is never followed or reused), written in full, then renamed over
    ``path`` (``overwrite=False``: linked to it, and left alone if ``path`` exists, returning False);
    removed on any failure.  A reader sees the old file or the whole new one, never a part.
    """
    target = os.fspath(path)
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    renamed = False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if overwrite:
            os.replace(tmp, target)
            renamed = True
            return True
        try:
            os.link(tmp, target)  # atomic, and fails if ``path`` exists: concurrent first uses end on one file
        except FileExistsError:
            return False
        return True
    finally:
        if not renamed:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # after a link or a failure: the random name goes


def warn_once(topic: str, where: str, message: str) -> None:
    """One :class:`UntrustedCacheWarning` per (topic, folder) and process (every refusal is logged and traced)."""
    from .. import diagnostics  # the runtime's log, imported at first use: trust.py is read by the CLI without it

    diagnostics.record_trust_refusal(topic, where, message)
    with _lock:
        if (topic, where) in _warned:
            return
        _warned.add((topic, where))
    warnings.warn(message, UntrustedCacheWarning, stacklevel=3)


def forget_warnings() -> None:
    """Warn again about folders already named (tests)."""
    with _lock:
        _warned.clear()
