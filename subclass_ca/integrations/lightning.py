"""A Lightning ``Callback`` that runs every backward inside ``subclass_ca.enable()``.

The one line: ``Trainer(callbacks=[subclass_ca.integrations.lightning.CompiledAutograd()])``.  Lightning
calls ``on_before_backward`` and ``on_after_backward`` around each backward, automatic optimization's and
``manual_backward``'s alike, so the callback opens a block at the first and closes it at the second;
``on_exception`` and ``teardown`` close a block a failed backward left open, so no block outlives the step
that raised.  Lightning has no compile setting of its own (a LightningModule is compiled with
``torch.compile``), so the CA graph's backend follows the forwards it captures (Note [Defaults follow the
user] in ``subclass_ca/config.py``) unless ``config=`` / ``backend=`` say otherwise.

Built on ``lightning.pytorch.Callback`` when the ``lightning`` package is installed, else on
``pytorch_lightning.Callback`` (a Trainer accepts only callbacks of its own package).
"""

from __future__ import annotations

import sys
from typing import Any

import subclass_ca

try:
    from lightning.pytorch import Callback
except ImportError:
    from pytorch_lightning import Callback

__all__ = ["CompiledAutograd"]


class CompiledAutograd(Callback):
    """Each backward of a Lightning ``Trainer`` inside one ``subclass_ca.enable()`` block.

    Takes what ``subclass_ca.enable`` takes: a ``config=`` (``subclass_ca.Config``) or its settings as
    keywords (``backend=``, ``dynamic=``, ...), validated here rather than at the first backward.
    """

    def __init__(self, backend: Any = None, *, config: subclass_ca.Config | None = None, **settings: Any) -> None:
        super().__init__()
        if config is None:
            config = subclass_ca.enable(backend, **settings).config
        elif backend is not None or settings:
            raise TypeError("CompiledAutograd(config=...) was also given settings: put them all in the Config")
        self.config = config
        self._open: subclass_ca.enable | None = None

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._close(None)  # a block left open by a backward that never reached on_after_backward
        block = subclass_ca.enable(config=self.config)
        block.__enter__()
        self._open = block

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._close(None)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close(exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close(None)

    def _close(self, exception: BaseException | None) -> None:
        block, self._open = self._open, None
        if block is None:
            return
        if exception is None:
            block.__exit__(None, None, None)
        else:
            block.__exit__(type(exception), exception, exception.__traceback__)

    @property
    def is_open(self) -> bool:
        """Whether a backward's block is open now (between ``on_before_backward`` and its close)."""
        return self._open is not None


# the package the callback was built on, for messages and tests
CALLBACK_PACKAGE: str = sys.modules[Callback.__module__].__name__.split(".")[0]
