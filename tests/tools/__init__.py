"""Tests of the developer tools (subclass_ca/_tools)."""
