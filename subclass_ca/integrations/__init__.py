"""One line per trainer: subclass_ca inside the training loops people already run.

Each submodule adapts one framework and imports it only when the submodule itself is imported
(``import subclass_ca`` never does): ``transformers`` (HF ``Trainer``, and accelerate),
``lightning`` (a ``Callback``), ``torchtune`` (a stock recipe run under ``enable()``) and
``torchtitan`` (a ``Trainer`` selected from its config).  They use the public API only
(``subclass_ca.enable``/``Config``), leave the block on every exit, exceptions included, and take
the CA graph's backend from the framework's own compile setting where it has one
(Note [Defaults follow the user] in ``config.py`` covers the rest).  ``docs/integrations.md``
shows each line; the pinned releases they are tested against are the ``integrations`` extra.
"""
