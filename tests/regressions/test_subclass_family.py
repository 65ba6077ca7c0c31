"""A subclass of a registered subclass keeps its own type (issue 16.3): the inherited handler rebuilds the child."""

from __future__ import annotations

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from tests.helpers import assert_same_grad

TwoTensor = _compat.two_tensor_type()
pytestmark = pytest.mark.skipif(TwoTensor is None, reason="torch.testing._internal.two_tensor is missing")

if TwoTensor is not None:

    class TaggedTwoTensor(TwoTensor):
        """A TwoTensor child: TwoTensor's dispatch builds ``cls``, its own unflatten returns the child."""

        @staticmethod
        def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
            return TaggedTwoTensor(inner_tensors["a"], inner_tensors["b"], outer_size, outer_stride)


def _train(backend: str | None, steps: int = 3):
    torch.manual_seed(0)
    dense = torch.randn(5, 5)
    weight = torch.nn.Parameter(TaggedTwoTensor(dense.clone(), dense * 2))
    optimizer = torch.optim.SGD([weight], lr=0.1)

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        return (x @ weight).sin().sum()

    forward = torch.compile(loss_fn, backend=backend) if backend else loss_fn
    grads = []
    for step in range(steps):
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(step))
        loss = forward(x)
        if backend:
            with subclass_ca.enable(backend=backend):
                loss.backward()
        else:
            loss.backward()
        grads.append(weight.grad.detach().clone() if type(weight.grad) is torch.Tensor else weight.grad.detach())
        optimizer.step()
        optimizer.zero_grad()
    return weight, grads


def test_inherited_handler_is_derived_for_the_child_class():
    handler = subclass_ca.get_handler(TaggedTwoTensor)
    assert handler.cls is TaggedTwoTensor and handler.inherited_from is TwoTensor
    assert "inherited from TwoTensor" in handler.name
    assert subclass_ca.get_handler(TaggedTwoTensor) is handler  # cached: one recipe key per capture


def test_child_of_registered_subclass_trains_with_its_own_grad_type_equal_to_eager():
    eager_weight, eager_grads = _train(None)
    assert type(eager_grads[0]) is TaggedTwoTensor  # the situation this test is about
    weight, grads = _train("aot_eager")
    for want, got in zip(eager_grads, grads):
        assert_same_grad(want, got)
    assert_same_grad(eager_weight.detach(), weight.detach())
    assert subclass_ca.last_report().nodes_for("TaggedTwoTensor") >= 1
