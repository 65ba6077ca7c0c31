"""Built-in handlers; each module registers itself on import (torchao's lazily: torchao is imported only if
installed and used)."""

from . import dtensor, torchao, two_tensor  # noqa: F401
