"""The testing kit: certify a wrapper subclass under subclass_ca against eager."""

from . import subclasses

__all__ = ["subclasses"]
