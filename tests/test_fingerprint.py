"""Stable descriptions of code and values (the keys of cached CA graphs, Note [Warm start through torch's caches])."""

from __future__ import annotations

import pytest
import torch

from subclass_ca._warm_start import fingerprint, keys
from subclass_ca._warm_start.fingerprint import Unstable, describe


class SelfNaming(torch.Tensor):
    """Its unflatten names the class itself: describing it must not recurse forever."""

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return SelfNaming._make_subclass(SelfNaming, inner["elem"])


def test_a_class_whose_protocol_names_itself_is_described_with_a_reference():
    text = describe(SelfNaming)
    assert "ref tests.test_fingerprint.SelfNaming" in text
    assert describe(SelfNaming) == text


def test_changed_code_changes_the_description():
    def rebuild_a(inner):
        return inner["a"]

    def rebuild_b(inner):
        return inner["b"]

    assert describe(rebuild_a).split(" ", 2)[2] != describe(rebuild_b).split(" ", 2)[2]


def test_values_are_described_by_content_and_addresses_are_refused():
    assert describe({"b": (1, torch.float32), "a": [torch.Size([2, 3])]}) == describe({"a": [torch.Size([2, 3])], "b": (1, torch.float32)})
    with pytest.raises(Unstable, match="memory address"):
        describe(object())
    with pytest.raises(Unstable, match="tensor"):
        describe(torch.ones(2))


def test_a_description_that_raises_keys_by_this_process_instead_of_failing_the_compile():
    def build():
        raise RecursionError("too deep")

    key = keys._stable("a failing description", build)
    assert key.startswith("process-local ") and "RecursionError" in fingerprint.uncacheable_reasons()["a failing description"]


def _generated_prologue(**module_globals):
    """A function generated the way AOT generates its backward prologue: exec'd code reading its globals."""
    namespace = dict(module_globals)
    exec("def _backward_prologue(grad):\n    return _scale_ * grad, _compile_id_\n", namespace)
    return namespace["_backward_prologue"]


def test_the_compile_id_of_generated_code_is_not_described_and_its_behaviour_is():
    """AOT's generated prologue names its Dynamo compile id, numbered per process in compile order, for error
    messages only: two processes that compile the same code in another order must get the same key (a restart whose
    forward replays a kept trace used to miss every regional piece after it), while what the code computes must not.
    """
    first = describe(_generated_prologue(_scale_=2.0, _compile_id_="2/0"))
    assert describe(_generated_prologue(_scale_=2.0, _compile_id_="1/0")) == first
    assert describe(_generated_prologue(_scale_=3.0, _compile_id_="2/0")) != first
