"""Handler registry: registration, validation errors, MRO lookup, read-only view, threads."""

from __future__ import annotations

import threading

import pytest
import torch

import subclass_ca
from subclass_ca.testing.subclasses import PairTensor, TaggedTensor, make_pair
from tests.helpers import assert_same_grad


class MyPair(PairTensor):
    """A PairTensor subclass: found through the MRO."""


@pytest.fixture
def cleanup():
    registered = []
    yield registered
    for cls in registered:
        if cls in subclass_ca.handlers():
            subclass_ca.unregister_handler(cls)


def rebuild_pair(inner, ctx, outer_size, outer_stride):
    return PairTensor(inner["a"], inner["b"], outer_size, outer_stride)


def test_register_and_lookup_follow_the_mro(cleanup):
    handler = subclass_ca.register_handler(PairTensor, rebuild=rebuild_pair)
    cleanup.append(PairTensor)
    assert subclass_ca.get_handler(PairTensor) is handler
    inherited = subclass_ca.get_handler(MyPair)
    assert inherited.inherited_from is PairTensor and inherited.cls is MyPair and inherited.mode == handler.mode
    assert subclass_ca.handlers()[PairTensor] is handler


def test_unregistered_subclass_falls_back_to_the_protocol_default():
    handler = subclass_ca.get_handler(TaggedTensor)
    assert handler.is_default and handler.mode == "proxy" and handler.cls is TaggedTensor


def test_handlers_view_is_read_only(cleanup):
    subclass_ca.register_handler(PairTensor, rebuild=rebuild_pair)
    cleanup.append(PairTensor)
    with pytest.raises(TypeError):
        subclass_ca.handlers()[MyPair] = subclass_ca.get_handler(PairTensor)  # type: ignore[index]


def test_decorator_form_registers_the_rebuild(cleanup):
    @subclass_ca.handler(PairTensor, mode="inline")
    def rebuild(inner, ctx, outer_size, outer_stride):
        return PairTensor(inner["a"], inner["b"], outer_size, outer_stride)

    cleanup.append(PairTensor)
    assert subclass_ca.get_handler(PairTensor).rebuild is rebuild
    assert subclass_ca.get_handler(PairTensor).mode == "inline"


def test_builtin_handlers_are_registered():
    from torch.distributed.tensor import DTensor

    from subclass_ca import _compat

    assert DTensor in subclass_ca.handlers()
    assert _compat.two_tensor_type() in subclass_ca.handlers()


def test_not_a_tensor_subclass_is_rejected_with_the_fix():
    with pytest.raises(subclass_ca.RegistrationError, match=r"torch.Tensor subclass.*int"):
        subclass_ca.register_handler(int)


def test_plain_tensor_is_rejected():
    with pytest.raises(subclass_ca.RegistrationError, match="not a wrapper subclass"):
        subclass_ca.register_handler(torch.Tensor)


def test_subclass_without_flatten_protocol_is_rejected():
    class NoProtocol(torch.Tensor):
        pass

    with pytest.raises(subclass_ca.RegistrationError, match=r"NoProtocol lacks __tensor_flatten__ and __tensor_unflatten__"):
        subclass_ca.register_handler(NoProtocol)


def test_duplicate_registration_raises_unless_replace(cleanup):
    subclass_ca.register_handler(PairTensor, rebuild=rebuild_pair)
    cleanup.append(PairTensor)
    with pytest.raises(subclass_ca.DuplicateHandlerError, match=r"PairTensor is already registered.*replace=True"):
        subclass_ca.register_handler(PairTensor)
    replaced = subclass_ca.register_handler(PairTensor, mode="opaque", replace=True)
    assert subclass_ca.get_handler(PairTensor) is replaced


def test_rebuild_with_wrong_signature_is_rejected():
    with pytest.raises(subclass_ca.RegistrationError, match=r"rebuild for PairTensor has signature \(inner\).*outer_stride"):
        subclass_ca.register_handler(PairTensor, rebuild=lambda inner: inner)


def test_metadata_key_with_wrong_signature_is_rejected():
    with pytest.raises(subclass_ca.RegistrationError, match=r"metadata_key for PairTensor"):
        subclass_ca.register_handler(PairTensor, metadata_key=lambda: None)


def test_unknown_mode_is_rejected():
    with pytest.raises(subclass_ca.RegistrationError, match=r"unknown mode 'fast' for PairTensor.*proxy"):
        subclass_ca.register_handler(PairTensor, mode="fast")  # type: ignore[arg-type]


def test_unregister_unknown_class_names_it():
    with pytest.raises(KeyError, match="MyPair"):
        subclass_ca.unregister_handler(MyPair)


def test_concurrent_registration_from_eight_threads_is_consistent():
    classes = [type(f"ThreadPair{i}", (PairTensor,), {}) for i in range(8)]
    barrier = threading.Barrier(8)
    errors = []

    def worker(cls):
        try:
            barrier.wait()
            for _ in range(50):
                subclass_ca.register_handler(cls, rebuild=rebuild_pair)
                assert subclass_ca.get_handler(cls).cls is cls
                subclass_ca.unregister_handler(cls)
            subclass_ca.register_handler(cls, rebuild=rebuild_pair)
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(cls,)) for cls in classes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors
        view = subclass_ca.handlers()
        assert all(view[cls].cls is cls for cls in classes)
    finally:
        for cls in classes:
            subclass_ca.unregister_handler(cls)


def test_registering_while_a_capture_runs_does_not_change_that_capture(cleanup, device):
    """The capture binds the handler it looked up; a registration mid-capture applies to later captures."""
    calls = []

    def first_rebuild(inner, ctx, outer_size, outer_stride):
        calls.append("first")
        if len(calls) == 1:  # first call happens during the capture: swap the handler under it
            subclass_ca.register_handler(PairTensor, rebuild=second_rebuild, replace=True)
        return PairTensor(inner["a"], inner["b"], outer_size, outer_stride)

    def second_rebuild(inner, ctx, outer_size, outer_stride):
        calls.append("second")
        return PairTensor(inner["a"] * 0, inner["b"] * 0, outer_size, outer_stride)

    subclass_ca.register_handler(PairTensor, rebuild=first_rebuild)
    cleanup.append(PairTensor)
    torch.manual_seed(0)
    dense, x = torch.randn(5, 5, device=device), torch.randn(3, 5, device=device)
    eager_w = torch.nn.Parameter(make_pair(dense))
    (x @ eager_w).sum().backward()
    ca_w = torch.nn.Parameter(make_pair(dense))
    loss = torch.compile(lambda x: (x @ ca_w).sum(), backend="aot_eager")(x)
    with subclass_ca.enable():
        loss.backward()
    assert "second" not in calls
    assert_same_grad(eager_w.grad, ca_w.grad)
