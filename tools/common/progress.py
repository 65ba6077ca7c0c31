"""The tools' one progress display: a tqdm bar on stderr, or plain lines where tqdm is missing.

``tqdm`` comes with the ``demo`` extra (and is on the GPU device); without it a tool prints one
line per item it starts (``line``), or nothing when the tool has no line to print.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """Progress of ``total`` units on ``stream`` (default stderr).

    * ``enabled=False``: prints nothing at all;
    * tqdm installed and ``bar=True``: a bar (``unit``, ``leave``), drawn at 0/total at once; :meth:`start` names
      the item being worked on in the bar's description;
    * otherwise (tqdm missing, or ``bar=False``): :meth:`start` prints ``line`` formatted with ``index`` (1-based), ``total``
      and ``name``; with ``line=None`` nothing is printed.
    """

    def __init__(self, total: int, *, enabled: bool = True, bar: bool = True, unit: str = "it", leave: bool = True,
                 line: str | None = "[{index}/{total}] {name} ...", stream: TextIO | None = None) -> None:
        self.total, self.index, self.enabled = total, 0, enabled
        self.stream = sys.stderr if stream is None else stream
        self._line = line
        self._bar: Any = None
        if not (enabled and bar):
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, unit=unit, leave=leave, file=self.stream, dynamic_ncols=True)
        self._bar.refresh()

    @property
    def has_bar(self) -> bool:
        """A tqdm bar is shown (False: tqdm is missing, or no bar was wanted)."""
        return self._bar is not None

    def start(self, name: str) -> None:
        """The next item (``name``) begins."""
        self.index += 1
        if self._bar is not None:
            self._bar.set_description(name[:48])
            self._bar.refresh()
        elif self.enabled and self._line is not None:
            print(self._line.format(index=self.index, total=self.total, name=name), file=self.stream, flush=True)

    def update(self, n: int = 1) -> None:
        """``n`` units are done."""
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
