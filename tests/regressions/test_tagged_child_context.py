"""A child of a registered subclass with its own flatten context never gets a stale context (issue 25.1).

``Tagged(TwoTensor)`` puts a tag in its flatten context; the tag changes between steps on the
same parameter.  TwoTensor's handler keys every context to ``None``; before the fix the child
inherited that key and its gradient came back with the first step's tag, without an error.
Note [Metadata keys never hide a context] (subclass_ca/_recipe.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import subclass_ca
from subclass_ca import _compat
from tests.helpers import assert_same_grad

TwoTensor = _compat.two_tensor_type()
pytestmark = pytest.mark.skipif(TwoTensor is None, reason="torch.testing._internal.two_tensor is missing")

if TwoTensor is not None:

    class Tagged(TwoTensor):
        """A TwoTensor with a string tag in its flatten context, propagated by every op."""

        def __new__(cls, a, b, outer_size=None, outer_stride=None, *, tag="", requires_grad=None):
            return super().__new__(cls, a, b, outer_size, outer_stride, requires_grad=requires_grad)

        def __init__(self, a, b, outer_size=None, outer_stride=None, *, tag="", requires_grad=None):
            self.a, self.b, self.tag = a, b, tag

        def __tensor_flatten__(self):
            return ["a", "b"], self.tag

        @staticmethod
        def __tensor_unflatten__(inner, tag, outer_size, outer_stride):
            return Tagged(inner["a"], inner["b"], outer_size, outer_stride, tag=tag)

        @classmethod
        def __torch_dispatch__(cls, func, types, args, kwargs=None):
            tags = [t.tag for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tagged)]
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, Tagged):
                    leaf.tag = tags[0] if tags else ""
            return out

    class Labelled(Tagged):
        """Registered below with a metadata key that ignores the tag its rebuild keeps (a user's bug)."""

        @staticmethod
        def __tensor_unflatten__(inner, tag, outer_size, outer_stride):
            return Labelled(inner["a"], inner["b"], outer_size, outer_stride, tag=tag)


def _train(mode: str, cls: type = None, backend: str = "aot_eager", steps: int = 3):
    cls = cls or Tagged
    torch.manual_seed(0)
    dense = torch.randn(5, 5)
    weight = torch.nn.Parameter(cls(dense.clone(), dense * 2, tag="t0"))
    loss_fn = lambda x: (x @ weight).sin().sum()  # noqa: E731
    forward = loss_fn if mode == "eager" else torch.compile(loss_fn, backend=backend)
    grads = []
    for step in range(steps):
        weight.tag = f"t{step}"  # same parameter, a new context every step
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(step))
        loss = forward(x)
        if mode == "subclass_ca":
            with subclass_ca.enable(backend=backend):
                loss.backward()
        else:
            loss.backward()
        grads.append(weight.grad)
        weight.grad = None
    return grads


def _assert_same(eager, got, *, exact=True):
    for step, (want, grad) in enumerate(zip(eager, got)):
        assert_same_grad(want, grad, exact=exact)
        assert grad.__tensor_flatten__() == want.__tensor_flatten__(), f"step {step}: context differs from eager"


def test_child_with_own_flatten_does_not_inherit_a_key_that_ignores_its_context():
    handler = subclass_ca.get_handler(Tagged)
    assert handler.inherited_from is TwoTensor
    assert handler.metadata_key("t0") != handler.metadata_key("t1")
    # a child that flattens exactly as its registered parent keeps the parent's key
    assert subclass_ca.get_handler(TwoTensor).metadata_key("x") == subclass_ca.get_handler(TwoTensor).metadata_key("y")


def test_tag_changing_between_steps_equals_eager_aot_eager():
    eager = _train("eager")
    assert [g.tag for g in eager] == ["t0", "t1", "t2"]  # the situation this test is about
    _assert_same(eager, _train("subclass_ca"))
    assert subclass_ca.diagnostics.recipe_count() >= 3


@pytest.mark.inductor
def test_tag_changing_between_steps_equals_eager_inductor():
    eager = _train("eager", steps=2)
    _assert_same(eager, _train("subclass_ca", backend="inductor", steps=2), exact=False)


@pytest.fixture
def labelled_handler_ignoring_the_tag():
    subclass_ca.register_handler(Labelled, metadata_key=lambda ctx: None)
    yield
    subclass_ca.unregister_handler(Labelled)


def test_key_that_hides_a_context_the_rebuild_reads_is_refused_at_capture(labelled_handler_ignoring_the_tag):
    with pytest.raises(subclass_ca.RebuildError) as caught:
        _train("subclass_ca", cls=Labelled, steps=2)
    text = str(caught.value)
    assert "registered handler for" in text and "Labelled" in text  # the handler
    assert "'t0'" in text and "'t1'" in text  # both contexts
    assert "stale context" in text and "Make metadata_key(ctx) cover every part" in text  # cause and fix


def test_key_ignoring_a_context_the_rebuild_does_not_read_is_accepted():
    """No false positive: a custom rebuild that drops the tag may share one recipe across tags."""

    def rebuild_untagged(inner, ctx, outer_size, outer_stride):
        return Labelled(inner["a"], inner["b"], outer_size, outer_stride, tag="")

    subclass_ca.register_handler(Labelled, rebuild=rebuild_untagged, metadata_key=lambda ctx: None)
    try:
        grads = _train("subclass_ca", cls=Labelled)
    finally:
        subclass_ca.unregister_handler(Labelled)
    eager = _train("eager", cls=Labelled)
    for want, got in zip(eager, grads):
        assert_same_grad(want, got)
        assert got.tag == ""  # what this handler rebuilds, every step
