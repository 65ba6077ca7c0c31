"""Tests of the repository's tools (tools/, not packaged; imported from the checkout)."""
