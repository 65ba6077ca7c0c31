"""The feature table: complete, and every missing piece is a clear error before any backward."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from subclass_ca.testing.subclasses import make_pair


def _remove(monkeypatch: pytest.MonkeyPatch, dotted: str | tuple[str, ...]) -> None:
    """Make ``dotted`` really absent (every present alternative of a tuple): delete its last attribute, or replace an
    immutable owner by a copy without it."""
    if not isinstance(dotted, str):
        for alternative in dotted:
            try:
                _compat.lookup(alternative)
            except (ImportError, AttributeError):
                continue
            _remove(monkeypatch, alternative)
        return
    module_name, _, attr_path = dotted.partition(":")
    *owner_path, last = attr_path.split(".")
    owner_dotted = module_name + (":" + ".".join(owner_path) if owner_path else "")
    owner = _compat.lookup(owner_dotted)
    try:
        monkeypatch.delattr(owner, last)
        return
    except (AttributeError, TypeError):
        pass
    stand_in = types.SimpleNamespace(**{name: getattr(owner, name) for name in dir(owner) if name != last and not name.startswith("__")})
    parent = _compat.lookup(module_name + (":" + ".".join(owner_path[:-1]) if owner_path[:-1] else ""))
    monkeypatch.setattr(parent, owner_path[-1], stand_in)


@pytest.fixture
def fresh_feature_check():
    _compat.forget_support_check()
    yield
    _compat.forget_support_check()


def test_this_torch_has_every_feature():
    assert _compat.missing_features() == ()


@pytest.mark.parametrize("feature", list(_compat.FEATURES))
def test_each_missing_feature_fails_enable_before_any_backward(feature, monkeypatch, fresh_feature_check):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(make_pair(torch.randn(4, 4)))
    loss = torch.compile(lambda x: (x @ weight).sum(), backend="aot_eager")(torch.randn(2, 4))
    _remove(monkeypatch, _compat.FEATURES[feature])
    with pytest.raises(subclass_ca.UnsupportedTorchError) as info:
        with subclass_ca.enable():
            loss.backward()
    monkeypatch.undo()
    message = str(info.value)
    assert feature in message and torch.__version__ in message and "pip install torch==" in message
    assert weight.grad is None, "a backward ran although the torch was unsupported"
    assert _compat.BLOCKS.depth == 0


def test_a_changed_signature_is_reported(monkeypatch, fresh_feature_check):
    compiler_cls = _compat.lookup(_compat.COMPILER_INSTANCE)
    monkeypatch.setattr(compiler_cls, "proxy_call_aot_backward", lambda self, ctx: None)
    assert any("AOT backward proxy signature" in m for m in _compat.missing_features())


def test_every_compat_lookup_is_in_a_feature_table():
    """Each dotted path a compat module resolves at run time is listed (required or optional)."""
    import re
    from pathlib import Path

    listed = {d for value in _compat.FEATURES.values() for d in ((value,) if isinstance(value, str) else value)}
    listed |= {dotted for dotted, _ in _compat.OPTIONAL_FEATURES.values()}
    listed |= set(_compat.PRECOMPILE_PARTS.values())  # all or nothing: precompile_supported()
    listed = {d.replace(":", ".") for d in listed}
    source = "\n".join(p.read_text() for p in Path(_compat.__file__).parent.glob("*.py"))
    for dotted in re.findall(r'lookup\("([\w.]+:[\w.]+)"\)', source):
        path = dotted.replace(":", ".")
        assert any(d.startswith(path) for d in listed), f"{dotted} is used by _compat but listed in no feature table"


def test_an_untested_torch_with_every_feature_runs_and_warns_once(monkeypatch):
    monkeypatch.setattr(_compat, "TORCH_VERSION", "2.16.0.dev20261201")
    monkeypatch.setattr(_compat, "_warned_untested", set())
    with pytest.warns(UserWarning, match=r"torch 2\.16\.0\.dev20261201 is untested"):
        with subclass_ca.enable():
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with subclass_ca.enable():
            pass


def test_an_untested_torch_missing_a_feature_raises_naming_it(monkeypatch, fresh_feature_check):
    monkeypatch.setattr(_compat, "TORCH_VERSION", "2.16.0")
    monkeypatch.setattr(_compat, "_warned_untested", set())
    _remove(monkeypatch, _compat.FEATURES["AccumulateGrad call"])
    with pytest.raises(subclass_ca.UnsupportedTorchError, match=r"torch 2\.16\.0 lacks: AccumulateGrad call"):
        with subclass_ca.enable():
            pass


def test_a_feature_with_alternatives_needs_only_one(monkeypatch, fresh_feature_check):
    """The backward epilogue has two shapes (Note [Two shapes of the AOT backward epilogue]): either suffices."""
    alternatives = _compat.FEATURES["AOT backward epilogue"]
    present = [d for d in alternatives if _compat._present(d)]
    assert len(present) == 1, f"this torch has {present} of {alternatives}"
    assert _compat.epilogue_style() in _compat.EPILOGUES
    assert _compat.EPILOGUES[_compat.epilogue_style()] == present[0]
    _remove(monkeypatch, present[0])
    assert any(m.startswith("AOT backward epilogue (") and " or " in m for m in _compat.missing_features())
