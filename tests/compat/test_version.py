"""The torch version gate: pip never sees a torch requirement, so enable() refuses an old torch itself."""

from __future__ import annotations

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from subclass_ca._compat import version
from subclass_ca.testing.subclasses import make_pair


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("2.11.0+cu130", (2, 11, 0)),
        ("2.12.1", (2, 12, 1)),
        ("2.16.0.dev20261201", (2, 16, 0)),
        ("2.15", (2, 15, 0)),
        (" 3.0.0a0+git1234", (3, 0, 0)),
    ],
)
def test_parse_torch_version(text, parsed):
    assert version.parse_torch_version(text) == parsed
    assert version.release(text) == f"{parsed[0]}.{parsed[1]}"


@pytest.mark.parametrize("text", ["", "cu130", "two.eleven", None])
def test_parse_torch_version_rejects_non_versions_naming_them(text):
    with pytest.raises(ValueError, match="not a torch version"):
        version.parse_torch_version(text)


def test_this_torch_is_a_tested_release():
    assert version.is_tested(torch.__version__), f"CI has no lane for torch {torch.__version__}"
    version.require_minimum(torch.__version__)  # no error


@pytest.fixture
def fresh_support_check():
    _compat.forget_support_check()
    yield
    _compat.forget_support_check()


@pytest.mark.parametrize("old", ["2.10.0", "2.10.1+cu128", "2.9.1", "1.13.1"])
def test_enable_refuses_a_torch_below_the_floor_naming_found_and_supported(old, monkeypatch, fresh_support_check):
    weight = torch.nn.Parameter(make_pair(torch.randn(4, 4)))
    loss = torch.compile(lambda x: (x @ weight).sum(), backend="aot_eager")(torch.randn(2, 4))
    monkeypatch.setattr(_compat, "TORCH_VERSION", old)
    with pytest.raises(subclass_ca.UnsupportedTorchError) as info:
        with subclass_ca.enable():
            loss.backward()
    message = str(info.value)
    assert f"found torch {old}" in message
    assert _compat.SUPPORTED_TORCH in message and ", ".join(_compat.TESTED_TORCH) in message
    assert "never changes your torch" in message
    assert weight.grad is None, "a backward ran under an unsupported torch"
    assert _compat.BLOCKS.depth == 0


def test_the_floor_is_the_oldest_tested_release():
    assert version.release(".".join(map(str, version.MINIMUM_TORCH))) == version.TESTED_TORCH[0]
    assert version.SUPPORTED_TORCH == ">=" + version.TESTED_TORCH[0]
