"""subclass_ca's own version, in a module of its own so that the runtime never imports the package root for it."""

__version__ = "0.1.0"
