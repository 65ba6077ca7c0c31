"""subclass_ca's own machinery lets no warning reach the user (issue 61, quiet runs)."""

from __future__ import annotations

import warnings

import pytest
import torch

import subclass_ca


@pytest.mark.inductor
def test_a_training_step_under_enable_inductor_warns_nothing():
    """An eager forward saves non-leaf activations; the CA graph's kept trace (inductor, cache on) pickles a guard
    on each of its inputs, and torch's pickler reads ``.grad`` of every one: a non-leaf's warned before.

    Warnings are recorded, not raised: ``simplefilter("error")`` fails stock compiled autograd's own capture, whose
    fakeification hides this very warning by ``warnings.showwarning`` (``torch._logging.hide_warnings``), which
    cannot stop an error."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with subclass_ca.enable(backend="inductor", cache=True):
                model(torch.randn(8, 16)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, UserWarning)] == []
