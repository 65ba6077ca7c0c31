"""enable() interns its settings: equal settings share one compiler and token, different ones never do.

Note [Interned settings] in subclass_ca/api.py.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import subclass_ca
from subclass_ca import api
from subclass_ca.testing.subclasses import make_pair
from tests.helpers import assert_same_grad

# One differing value per Config field (the default is the other side of each pair).
DIFFERENT = {
    "backend": ({"backend": "aot_eager"}, {"backend": "eager"}),
    "dynamic": ({}, {"dynamic": False}),
    "strict": ({}, {"strict": True}),
    "on_unsupported": ({}, {"on_unsupported": "eager"}),
    "report": ({}, {"report": True}),
    "fullgraph": ({}, {"fullgraph": False}),
    "cache": ({}, {"cache": False}),
    "regional": ({}, {"regional": False}),
    "compile_kwargs": ({"mode": "default"}, {"mode": "max-autotune-no-cudagraphs"}),
    "compile_kwargs unhashable value": ({"options": {"trace.enabled": False}}, {"options": {"trace.enabled": True}}),
    "compile_kwargs value type": ({"disable": False}, {"disable": 0}),
    "compile_kwargs present or not": ({}, {"disable": False}),
}


_FIELDS = {f.name for f in dataclasses.fields(subclass_ca.Config)}


def _config(kwargs: dict) -> subclass_ca.Config:
    """The Config enable(**kwargs) means."""
    compile_kwargs = {k: v for k, v in kwargs.items() if k not in _FIELDS}
    return subclass_ca.Config(**{k: v for k, v in kwargs.items() if k in _FIELDS}, compile_kwargs=compile_kwargs)


def test_the_table_covers_every_config_field():
    assert {name.split()[0] for name in DIFFERENT} == _FIELDS


@pytest.mark.parametrize("name", list(DIFFERENT))
def test_different_settings_never_share_a_compiler(name):
    first_kwargs, second_kwargs = DIFFERENT[name]
    first, second = subclass_ca.enable(**first_kwargs), subclass_ca.enable(**second_kwargs)
    assert first._compiler is not second._compiler
    assert repr(first.config) != repr(second.config)  # repr: Config's == takes disable=0 for disable=False
    assert repr(second._compiler.subclass_ca_config) == repr(_config(second_kwargs))
    if name != "report":  # report changes what is logged, not the graph: the CA cache is shared
        assert first._token != second._token
    # the same keywords again (also in another order, and through config=) find the same compiler
    assert subclass_ca.enable(**dict(reversed(list(second_kwargs.items()))))._compiler is second._compiler
    assert subclass_ca.enable(config=_config(second_kwargs))._compiler is second._compiler


def test_equal_settings_share_one_config_compiler_and_token():
    first = subclass_ca.enable(backend="aot_eager", strict=True, mode="default")
    second = subclass_ca.enable(mode="default", strict=True, backend="aot_eager")
    from_config = subclass_ca.enable(config=subclass_ca.Config(backend="aot_eager", strict=True, compile_kwargs={"mode": "default"}))
    assert second._compiler is first._compiler and from_config._compiler is first._compiler
    assert second.config is first.config and from_config.config == first.config
    assert second._token == first._token == from_config._token
    assert first._compiler.factory is second._compiler.factory
    # defaults spelled out are the same settings as defaults left out (backend=None: follow the forwards)
    spelled = subclass_ca.enable(backend=None, dynamic=None, strict=False, on_unsupported="error", fullgraph=True)
    assert spelled._compiler is subclass_ca.enable()._compiler


def test_a_fresh_enable_with_equal_settings_reuses_the_captured_graph():
    torch.manual_seed(0)
    dense = torch.randn(6, 6)
    eager_w = torch.nn.Parameter(make_pair(dense.clone()))
    ca_w = torch.nn.Parameter(make_pair(dense.clone()))
    x = torch.randn(4, 6)
    step = torch.compile(lambda x: (x @ ca_w).tanh().sum(), backend="aot_eager")
    (x @ eager_w).tanh().sum().backward()
    for _ in range(2):
        ca_w.grad = None
        with subclass_ca.enable(backend="aot_eager", strict=True):  # a new object each step, as users write it
            step(x).backward()
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] == 1
    assert_same_grad(eager_w.grad, ca_w.grad)


def test_seen_keywords_skip_building_and_validating_a_config(monkeypatch):
    first = subclass_ca.enable(backend="aot_eager", on_unsupported="eager")

    def refuse(**kwargs):
        raise AssertionError("a Config was built for keywords seen before")

    monkeypatch.setattr(api, "Config", refuse)
    assert subclass_ca.enable(backend="aot_eager", on_unsupported="eager")._compiler is first._compiler


def test_a_flag_equal_to_a_seen_bool_is_still_rejected():
    subclass_ca.enable(dynamic=True)
    with pytest.raises(ValueError, match="dynamic must be None, True or False, got 1"):
        subclass_ca.enable(dynamic=1)


def test_a_backend_name_is_looked_up_in_torch_once(monkeypatch):
    subclass_ca.enable(backend="eager", fullgraph=False)

    def refuse(*args, **kwargs):
        raise AssertionError("list_backends was called again for a name already validated")

    monkeypatch.setattr(torch.compiler, "list_backends", refuse)
    subclass_ca.enable(config=subclass_ca.Config(backend="eager", strict=True, fullgraph=False))


def test_cache_miss_logging_is_decided_at_each_construction():
    logger = logging.getLogger("subclass_ca")
    if logger.isEnabledFor(logging.INFO):
        pytest.skip("SUBCLASS_CA_LOG asks for cache-miss reasons in this run")
    level = logger.level
    quiet = subclass_ca.enable(backend="aot_eager", dynamic=False)
    try:
        logger.setLevel(logging.INFO)
        loud = subclass_ca.enable(backend="aot_eager", dynamic=False)
    finally:
        logger.setLevel(level)
    assert loud._compiler is quiet._compiler
    assert loud._miss_log and not quiet._miss_log


def test_unknown_backend_error_lists_user_facing_backends_only():
    with pytest.raises(ValueError) as info:
        subclass_ca.enable(backend="no_such_backend")
    message = str(info.value)
    assert "unknown backend 'no_such_backend'" in message and "callable" in message  # the cause and the fix
    for name in torch.compiler.list_backends():  # torch's user-facing backends, plus aot_eager and eager
        assert repr(name) in message
    assert "'aot_eager'" in message and "'eager'" in message
    assert "TESTING_ONLY" not in message and "minifier" not in message


def test_the_settings_are_declared_once_as_config_fields():
    """enable()'s keywords, the CA cache key and the flag validation all derive from Config's fields."""
    import dataclasses
    import inspect

    from subclass_ca import config as config_module

    fields = [f.name for f in dataclasses.fields(subclass_ca.Config)]
    assert config_module.SETTINGS == tuple(f for f in fields if f != "compile_kwargs")
    keywords = [p.name for p in inspect.signature(subclass_ca.enable.__init__).parameters.values()
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("self", "config")]
    assert sorted(keywords) == sorted(config_module.SETTINGS), "enable() and Config disagree on the settings"
    assert "report" not in config_module.CACHE_KEYED_SETTINGS  # read by the compiler, not a different graph
    assert set(config_module.FLAGS) == {"strict", "report", "fullgraph", "cache", "regional"}  # dynamic: None, True or False
    base = subclass_ca.Config()
    for name in config_module.CACHE_KEYED_SETTINGS:
        if name in config_module.FLAGS:
            changed = dataclasses.replace(base, **{name: not getattr(base, name)})
            assert config_module.cache_key(changed) != config_module.cache_key(base), name
