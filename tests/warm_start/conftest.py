"""Fixtures of the warm-start trust tests: a cache folder of this user's, and a guard that turns a hang into a failure."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from subclass_ca import _compat
from subclass_ca._warm_start import traced, trust


@pytest.fixture
def cache_folder(tmp_path, monkeypatch) -> Iterator[Path]:
    """An empty cache folder of this user's, as torch's cache_dir(); no record loaded from a file; warnings fresh."""
    folder = tmp_path / "inductor-cache"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(_compat, "cache_dir", lambda: str(folder))
    monkeypatch.setattr(traced, "_records", {})
    monkeypatch.setattr(traced, "_pending", {})
    trust.forget_warnings()
    yield folder
    trust.forget_warnings()


class Hung(AssertionError):
    """A call that should have returned at once blocked (a FIFO opened for reading waits for a writer)."""


@contextlib.contextmanager
def _within(seconds: float = 10.0) -> Iterator[None]:
    """Fail with :class:`Hung` if the body blocks longer than ``seconds`` (SIGALRM interrupts a blocking open or read)."""

    def fail(signum, frame):
        raise Hung(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def no_hang():
    """``with no_hang():`` fails the test with :class:`Hung` instead of hanging it (every FIFO test uses it)."""
    return _within
