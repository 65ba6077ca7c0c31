"""Built-in handlers; each module registers itself on import."""

from . import dtensor, two_tensor  # noqa: F401
from . import torchao  # noqa: F401  (registers lazily: torchao is imported only if installed and used)
