"""Forwards compiled outside a block (Note [Forwards compiled outside a block]): torch's key is left alone unless a
marker this user signed names it; the fresh-process restarts are in tests/test_cache.py."""

from __future__ import annotations

import collections
import os

import pytest
import torch

import subclass_ca
from subclass_ca._warm_start import keys, outside, traced
from subclass_ca.testing.subclasses import PairTensor


@pytest.fixture
def empty(monkeypatch, cache_folder):
    """No remembered forward, no record held in this process, an empty cache folder of this user's."""
    monkeypatch.setattr(outside, "_seen", collections.OrderedDict())
    return cache_folder


def _forward() -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    module = torch.fx.symbolic_trace(lambda a: torch.tanh(a) * 2)
    return module, [PairTensor(torch.ones(2, 3), torch.full((2, 3), 2.0))]


def test_an_unmarked_forward_keeps_torchs_key_and_is_remembered_for_save_cache(empty):
    module, inputs = _forward()
    assert outside.outside_extension(module, inputs, "a-torch-key") is None
    assert list(outside._seen) == ["a-torch-key"]
    assert outside.outside_extension(module, [torch.ones(2, 3)], "a-plain-key") is None  # torch's key describes it
    assert list(outside._seen) == ["a-torch-key"]


def test_a_marked_forward_gets_its_behaviour_key_and_no_other_does(empty):
    module, inputs = _forward()
    traced.mark("a-torch-key")
    assert traced.marked("a-torch-key") and not traced.marked("another-key")
    assert outside.outside_extension(module, inputs, "a-torch-key") == keys.behaviour_key(module, inputs)
    assert outside.outside_extension(module, inputs, "another-key") is None
    assert "a-torch-key" not in outside._seen  # found by its marker, nothing to remember


def test_only_the_last_forwards_are_remembered(empty, monkeypatch):
    monkeypatch.setattr(outside, "REMEMBERED", 2)
    module, inputs = _forward()
    for name in ("first", "second", "third"):
        outside.outside_extension(module, inputs, name)
    assert list(outside._seen) == ["second", "third"]


def test_a_marker_is_a_record_but_not_a_kept_trace(empty):
    traced.mark("a-torch-key")
    records = traced.signable_records(b"k" * 32)
    assert list(records) == [traced.MARKER_PREFIX + "a-torch-key"] and traced.trace_count(records) == 0


def test_only_a_marker_this_user_signed_names_a_forward(empty, monkeypatch):
    """A marker is read back as a kept trace is (Note [Trusting a compile cache]): one this user's key signed into the
    folder names its forward in a later process; the same bytes planted unsigned beside it name nothing."""
    traced.mark("a-torch-key")
    assert traced.write_records() == 1
    monkeypatch.setattr(traced, "_records", {})  # a later process: only the folder holds it
    assert traced.marked("a-torch-key")
    planted = os.path.join(traced.records_folder(), traced.MARKER_PREFIX + "planted-key")
    with open(planted, "wb") as f:
        f.write(traced._MARKER)
    os.chmod(planted, 0o600)
    with pytest.warns(subclass_ca.UntrustedCacheWarning, match="not signed with your key"):
        assert not traced.marked("planted-key")
