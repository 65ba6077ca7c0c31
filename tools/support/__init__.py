"""The support table (``table``: ``python -m tools versions``, ``make versions``): docs/versions.md from real runs on
every torch lane."""
