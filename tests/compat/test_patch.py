"""The one patcher: counted, re-entrant, exact restore (Note [One patcher]); enable() blocks use it."""

from __future__ import annotations

import threading
import types

import pytest
import torch

import subclass_ca
from subclass_ca import _compat, _runtime
from subclass_ca.testing.subclasses import PairTensor, make_pair
from subclass_ca.errors import SubclassCAError


def _target():
    owner = types.SimpleNamespace(fn=lambda: "original")
    original = owner.fn
    patches = _compat.PatchSet("test", lambda: [_compat.AttributeSwap(lambda: owner, "fn", lambda orig: (lambda: "patched"))])
    return owner, original, patches


def test_first_acquire_installs_last_release_restores_the_identical_object():
    owner, original, patches = _target()
    patches.acquire()
    patches.acquire()
    assert owner.fn() == "patched"
    patches.release()
    assert owner.fn() == "patched"
    patches.release()
    assert owner.fn is original


def test_release_without_acquire_raises_and_keeps_the_count():
    owner, original, patches = _target()
    with pytest.raises(RuntimeError, match="released more often than acquired"):
        patches.release()
    with patches.applied():
        assert owner.fn() == "patched"
    assert owner.fn is original and patches.holders == 0


def test_an_exception_inside_restores():
    owner, original, patches = _target()
    with pytest.raises(KeyError), patches.applied():
        raise KeyError
    assert owner.fn is original


def test_a_failing_install_undoes_what_it_already_did():
    owner = types.SimpleNamespace(a=1, b=2)

    def broken(_):
        raise ValueError("cannot build replacement")

    patches = _compat.PatchSet(
        "test",
        lambda: [_compat.AttributeSwap(lambda: owner, "a", lambda _: 10), _compat.AttributeSwap(lambda: owner, "b", broken)],
    )
    with pytest.raises(ValueError):
        patches.acquire()
    assert (owner.a, owner.b, patches.holders) == (1, 2, 0)


def test_acquire_and_release_from_many_threads_balance():
    owner, original, patches = _target()
    barrier = threading.Barrier(4)

    def work():
        barrier.wait()
        for _ in range(200):
            with patches.applied():
                assert owner.fn() == "patched"

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert owner.fn is original and patches.holders == 0


def _pair_step():
    torch.manual_seed(0)
    w = torch.nn.Parameter(make_pair(torch.randn(6, 6)))
    return w, torch.compile(lambda x: (x @ w).tanh().sum(), backend="aot_eager"), torch.randn(4, 6)


def test_enable_patches_only_through_the_runtime_patch_set_and_restores_identically():
    before = _compat.torch_state_snapshot()
    w, step, x = _pair_step()
    with subclass_ca.enable():
        installed = _runtime.RUNTIME_PATCHES.installed()
        assert any("proxy_call_aot_backward" in name for name in installed)
        assert any("_compiled_autograd_key" in name for name in installed)
        with subclass_ca.enable(strict=True):
            assert _runtime.RUNTIME_PATCHES.holders == 2
            step(x).backward()
    after = _compat.torch_state_snapshot()
    for key, value in before.items():
        assert after[key] is value or after[key] == value, key
    assert isinstance(w.grad, PairTensor)


def test_blocks_exited_out_of_order_restore_torch_and_raise_clearly():
    """Issue 21.2: outer exits while inner is open -> inner closed first, state restored, clear error."""
    before = _compat.torch_state_snapshot()
    outer, inner = subclass_ca.enable(), subclass_ca.enable(strict=True)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(SubclassCAError, match="exited out of order"):
        outer.__exit__(None, None, None)
    assert _compat.torch_state_snapshot() == before
    assert inner.__exit__(None, None, None) is False  # already closed: a no-op
    assert _compat.torch_state_snapshot() == before
    autograd_key = _compat.lookup(_compat.compiled_autograd.AUTOGRAD_FUNCTION_CTX).__dict__["_compiled_autograd_key"]
    assert autograd_key is before["autograd_function_ca_key"]
    # and the process is usable: a normal block trains
    w, step, x = _pair_step()
    with subclass_ca.enable():
        step(x).backward()
    assert isinstance(w.grad, PairTensor)


def test_out_of_order_exit_after_an_exception_still_restores():
    before = _compat.torch_state_snapshot()
    outer, inner = subclass_ca.enable(), subclass_ca.enable()
    outer.__enter__()
    inner.__enter__()
    try:
        raise RuntimeError("user error")
    except RuntimeError as error:
        with pytest.raises(SubclassCAError):
            outer.__exit__(type(error), error, error.__traceback__)
    assert _compat.torch_state_snapshot() == before
