"""Keys by behaviour (Note [Keys by behaviour]): what a graph traces to, not what its code is called.

In-process and without inductor: each indirection of the ``knobs`` package changes the key when the
value behind it changes and gives the same key back when it is restored; the multi-process
restarts (stale hits and replays) are in ``tests/warm_start/test_never_stale.py``.
"""

from __future__ import annotations

import importlib.metadata
import sys

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from subclass_ca._warm_start import cacheable, fingerprint, keys
from subclass_ca._warm_start.fingerprint import Unstable
from subclass_ca.config import CACHE_ENV, Config
from tests.warm_start.knobs_package import TYPES, write_package


@pytest.fixture(scope="module")
def knobs(tmp_path_factory):
    folder = write_package(tmp_path_factory.mktemp("knobs"), scale=2.0, version="1.0")
    sys.path.insert(0, str(folder))
    _forget_distributions()
    import knobs.types

    yield knobs
    sys.path.remove(str(folder))
    for name in [m for m in sys.modules if m == "knobs" or m.startswith("knobs.")]:
        del sys.modules[name]
    _forget_distributions()


def _forget_distributions() -> None:
    keys._distributions.cache_clear()
    keys._providers.cache_clear()


def _key(cls: type) -> str:
    weight = torch.nn.Parameter(cls(torch.ones(3, 3), torch.ones(3, 3)))
    return keys.behaviour_key(lambda w, x: (x @ w).tanh().sum(), [weight, torch.ones(2, 3)])


def _change(knobs, name: str, monkeypatch) -> None:
    """Change the value ``name``'s indirection reaches to 1.0, as the "fix" version of the package does."""
    types = knobs.types
    if name == "ConstPair":
        monkeypatch.setattr(knobs.consts, "K", 1.0)
    elif name in ("FuncPair", "UpgradePair"):
        module = knobs.funcs if name == "FuncPair" else knobs.upgrade
        monkeypatch.setattr(module, "scale", lambda a: a * 1.0)
    elif name == "ClassAttrPair":
        monkeypatch.setattr(types.ClassAttrPair, "K", 1.0)
    elif name == "StaticPair":
        monkeypatch.setattr(types.StaticPair, "_times", staticmethod(lambda a: a * 1.0))
    elif name == "EnumPair":
        monkeypatch.setattr(knobs.modes.Mode.SCALE, "_value_", 1.0)
    elif name == "HiddenPair":
        monkeypatch.setattr(knobs.hidden.HIDDEN, "_k", 1.0)
    elif name == "ClosurePair":
        monkeypatch.setitem(knobs.closures._state, "k", 1.0)
    elif name == "DispatchPair":
        monkeypatch.setattr(knobs.dispatch, "post", lambda t: t * 1.0)
    else:
        raise AssertionError(name)


@pytest.mark.parametrize("name", TYPES)
def test_every_indirection_changes_the_key_and_restoring_it_gives_the_key_back(knobs, name):
    cls = getattr(knobs.types, name)
    before = _key(cls)
    assert _key(cls) == before  # deterministic
    with pytest.MonkeyPatch.context() as patch:
        _change(knobs, name, patch)
        assert _key(cls) != before, f"{name}: the key did not see the change"
    assert _key(cls) == before


def test_the_installed_version_of_a_subclass_package_is_in_the_key(knobs, monkeypatch):
    before = _key(knobs.types.FuncPair)
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9" if name == "knobs" else real(name))
    assert _key(knobs.types.FuncPair) != before


def test_the_providers_of_a_package_are_those_of_importlibs_full_scan(knobs, tmp_path, monkeypatch):
    """The quick lookup (one distribution read) names what ``packages_distributions()`` names: for every top-level
    package imported here, the test package, and a namespace package two distributions share (the full scan)."""
    for dist in ("nsknobs_a", "nsknobs_b"):  # each installs its own module into the namespace package nsknobs
        (tmp_path / "nsknobs").mkdir(exist_ok=True)
        (tmp_path / "nsknobs" / f"{dist}.py").write_text("VALUE = 1\n")
        info = tmp_path / f"{dist}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "RECORD").write_text(f"nsknobs/{dist}.py,,\n{info.name}/METADATA,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import nsknobs.nsknobs_a  # noqa: F401

    try:
        _forget_distributions()
        full = importlib.metadata.packages_distributions()
        tops = sorted(top for top in full if top in sys.modules)
        assert {"knobs", "nsknobs", "torch", "pytest"} <= set(tops)
        for top in tops:
            assert set(keys._providers(top)) == set(full[top]), top  # the full scan may name one twice
        assert sorted(keys._providers("nsknobs")) == ["nsknobs_a", "nsknobs_b"]
        assert keys._versions([knobs.types.FuncPair]) == ["knobs==1.0"]
    finally:
        for name in [m for m in sys.modules if m == "nsknobs" or m.startswith("nsknobs.")]:
            del sys.modules[name]
        _forget_distributions()


def test_two_subclass_types_that_trace_alike_have_two_keys(knobs):
    """torch's own key names a subclass input only by its flatten metadata; ours has its type."""
    assert _key(knobs.types.FuncPair) != _key(knobs.types.ConstPair)


def test_the_arguments_are_never_touched(knobs):
    weight = torch.nn.Parameter(knobs.types.FuncPair(torch.ones(3, 3), torch.ones(3, 3)))
    inputs = [weight, torch.ones(2, 3)]

    def step(w, x):
        (x @ w).sum().backward()

    keys.behaviour_key(step, inputs)
    assert weight.grad is None and inputs[0] is weight


def test_symbolic_inputs_have_no_key():
    with pytest.raises(Unstable, match="symbolic"):
        keys.behaviour_key(lambda n: torch.ones(n), [_symint()])


def _symint():
    shape_env = torch.fx.experimental.symbolic_shapes.ShapeEnv()
    return shape_env.create_unbacked_symint()


def test_a_graph_that_cannot_be_traced_has_no_key_and_the_reason_is_kept():
    def untraceable(x):
        raise RuntimeError("not today")

    key = keys.cross_process_key("an untraceable graph", untraceable, [torch.ones(2)])
    assert key.startswith(f"process-local {fingerprint.NONCE} ")
    assert "not today" in fingerprint.uncacheable_reasons()["an untraceable graph"]


def test_aot_keys_of_plain_graphs_stay_torchs_and_untraceable_ones_bypass_the_cache(knobs):
    plain = torch.fx.symbolic_trace(lambda x: x.sin())
    assert keys.aot_key_extension(plain, [torch.ones(2)], None) is None

    weight = knobs.types.FuncPair(torch.ones(2), torch.ones(2))
    assert keys.aot_key_extension(plain, [weight], None) is not None  # a subclass input: keyed by behaviour

    broken = torch.fx.symbolic_trace(lambda x: x.sin())
    broken.forward = lambda x: (_ for _ in ()).throw(RuntimeError("no trace"))
    with pytest.raises(_compat.Uncacheable, match="no trace"):
        keys.aot_key_extension(broken, [weight], None)


def test_cache_false_keeps_ca_graphs_out_of_torchs_caches(monkeypatch):
    graph = torch.fx.symbolic_trace(lambda x: x.sin())
    monkeypatch.setattr(cacheable, "cacheable_names", lambda gm: ["torch._dynamo.compiled_autograd.ops.validate_outputs"])
    kept = cacheable.compile_kwargs(graph, Config(backend="inductor", cache=False))
    assert kept == {}
    assert cacheable.compile_kwargs(graph, Config(backend="inductor", compile_kwargs={"mode": "max-autotune"})) == {
        "mode": "max-autotune"}  # a mode: torch's persistent caches do not serve it
    assert cacheable.compile_kwargs(graph, Config(backend="aot_eager")) == {}
    if _compat.marked_cacheable_supported() and _compat.aot_key_swap_supported():
        admitted = cacheable.compile_kwargs(graph, Config(backend="inductor", cache=True))
        assert _compat.MARKED_CACHEABLE_OPTION in admitted["options"]


def test_the_persistent_cache_rule_lives_on_the_config():
    assert Config(backend="inductor").persistent_caches
    assert not Config(backend="inductor", cache=False).persistent_caches
    assert not Config(backend="inductor", compile_kwargs={"mode": "reduce-overhead"}).persistent_caches
    assert not Config(backend="aot_eager").persistent_caches
    assert not Config().persistent_caches  # backend=None: resolved per capture first (config.followed)


def test_the_environment_turns_the_cache_off_by_default(monkeypatch):
    assert Config().cache is True
    monkeypatch.setenv(CACHE_ENV, "0")
    assert Config().cache is False
    assert Config(cache=True).cache is True
    with pytest.raises(ValueError, match="cache"):
        Config(cache="no")
    with subclass_ca.enable(cache=False) as block:
        assert block.config.cache is False
