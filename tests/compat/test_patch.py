"""The one patcher: counted, re-entrant, exact restore (Note [One patcher]); resident gated sets (Note [Resident patches])."""

from __future__ import annotations

import threading
import types

import pytest
import torch

import subclass_ca
from subclass_ca import _compat, _runtime
from subclass_ca.errors import SubclassCAError
from subclass_ca.testing.subclasses import PairTensor, make_pair


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


def test_enable_patches_only_through_the_runtime_patch_set_and_reset_restores_identically():
    subclass_ca.reset()  # a process state with nothing of ours installed
    raw_before = _compat.torch_state_snapshot(effective=False)
    before = _compat.torch_state_snapshot()
    w, step, x = _pair_step()
    with subclass_ca.enable():
        installed = _runtime.RUNTIME_PATCHES.installed()
        assert any("proxy_call_aot_backward" in name for name in installed)
        assert any("_compiled_autograd_key" in name for name in installed)
        with subclass_ca.enable(strict=True):
            assert _compat.BLOCKS.depth == 2
            step(x).backward()
    assert isinstance(w.grad, PairTensor)
    # after the block: torch behaves as before (every resident gate calls torch's original) ...
    assert _compat.torch_state_snapshot() == before
    raw_after = _compat.torch_state_snapshot(effective=False)
    resident = [key for key in raw_before if raw_after[key] is not raw_before[key] and raw_after[key] != raw_before[key]]
    assert resident, "the runtime patches should stay installed between blocks"
    for key in resident:
        values = raw_after[key].values() if isinstance(raw_after[key], dict) else [raw_after[key]]
        gates = (_compat.BLOCKS, _compat.CA_GRAPH_RUN, *_compat.workarounds.SCOPES.values())
        assert all(any(getattr(v, "__subclass_ca_gate__", None) is gate for gate in gates) for v in values), key
    # ... and reset() puts every attribute back to the identical object
    subclass_ca.reset()
    raw_reset = _compat.torch_state_snapshot(effective=False)
    for key, value in raw_before.items():
        assert raw_reset[key] is value or raw_reset[key] == value, key
    assert not _runtime.RUNTIME_PATCHES.is_installed


def test_a_resident_set_installs_once_and_its_gates_act_only_inside_their_scope():
    owner = types.SimpleNamespace(fn=lambda value: ("original", value))
    original = owner.fn
    scope = _compat.Scope("test scope")
    patches = _compat.PatchSet(
        "test",
        lambda: [_compat.AttributeSwap(lambda: owner, "fn", lambda orig: _compat.gated(scope, orig, lambda v: ("patched", v)))],
        resident=True,
    )
    patches.install()
    installed = owner.fn
    patches.install()
    assert owner.fn is installed  # installed once
    assert owner.fn(1) == ("original", 1)  # outside its scope: torch's original, same arguments
    scope.enter()
    assert owner.fn(2) == ("patched", 2)
    scope.exit()
    assert owner.fn(3) == ("original", 3)
    with pytest.raises(RuntimeError, match="exited more often than entered"):
        scope.exit()
    with pytest.raises(RuntimeError, match="is resident"):
        patches.acquire()
    patches.uninstall()
    assert owner.fn is original


def test_restoring_never_drops_a_patch_other_code_made_over_ours():
    owner = types.SimpleNamespace(fn=lambda: "original")
    patches = _compat.PatchSet("test", lambda: [_compat.AttributeSwap(lambda: owner, "fn", lambda orig: lambda: "ours")],
                               resident=True)
    patches.install()
    theirs = lambda: "theirs"  # noqa: E731
    owner.fn = theirs
    with pytest.raises(RuntimeError, match=r"'test'.*fn.*replaced by other code"):
        patches.uninstall()
    assert owner.fn is theirs and not patches.is_installed


def test_reset_inside_a_block_keeps_the_patches_it_needs():
    w, step, x = _pair_step()
    with subclass_ca.enable():
        subclass_ca.reset()
        assert _runtime.RUNTIME_PATCHES.is_installed
        step(x).backward()
    assert isinstance(w.grad, PairTensor)
    with pytest.raises(RuntimeError, match="while an enable\\(\\) block is open"):
        with subclass_ca.enable():
            _compat.uninstall_resident()


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
    assert _compat.BLOCKS.depth == 0  # every gate is back to calling torch's original
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
