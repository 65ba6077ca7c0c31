"""Regression found by tests/testing/test_fuzz.py (shrunk): int8 / chunked operands through ``view``, batch size changing.

Model(structure=("tanh", "view", "matmul", "tangent"), kind="int8", placement="all"): the second
backward (batch 3 -> 5) is captured with dynamic sizes and the AOT backward graph holds
``aten.sym_numel``, which Dynamo refuses in the fullgraph CA graph ("torch.* op returned
non-Tensor").  Stock compiled autograd fails identically, so this is torch's: the fuzz leaves
the combination out (``known_torch_limitation``) and this file tracks it, probing stock CA on
the running torch: where stock fails we must fail the same way, where it works (int8 on torch
2.14/2.15) we must match eager.  chunked still fails on 2.15.
"""

from __future__ import annotations

import pytest
import torch

import subclass_ca
from subclass_ca.testing import compare_values
from subclass_ca.testing.subclasses import make_chunked, make_int8


def _chain(x, w):
    h = torch.tanh(x)
    h = h.view(-1).view(x.shape[0], -1)
    return h @ w


def _steps(make, backward_ctx):
    step = torch.compile(_chain, backend="aot_eager")
    problems = []
    for batch in (3, 5, 2):
        generator = torch.Generator().manual_seed(batch)
        xd, wd, gd = (torch.randn(*s, generator=generator) for s in ((batch, 4), (4, 4), (batch, 4)))
        runs = []
        for compiled in (False, True):
            x, w = make(xd).requires_grad_(), make(wd).requires_grad_()
            out = (step if compiled else _chain)(x, w)
            if compiled:
                with backward_ctx():
                    out.backward(make(gd))
            else:
                out.backward(make(gd))
            runs.append({"out": out, "x.grad": x.grad, "w.grad": w.grad})
        problems += compare_values(*runs)[0]
    return problems


def _stock() -> object:
    return torch._dynamo.compiled_autograd._enable(lambda gm: torch.compile(gm, backend="aot_eager", fullgraph=True))


def _stock_has_the_limitation(make) -> bool:
    """Probe this torch: does stock CA refuse sym_numel here? (2.13: int8 and chunked; 2.15: chunked only)."""
    try:
        problems = _steps(make, _stock)
    except Exception as error:
        if "non-Tensor" in str(error):
            return True
        raise
    assert problems == [], problems  # where stock CA runs it, it matches eager
    return False


@pytest.mark.parametrize("make", [make_int8, make_chunked], ids=["int8", "chunked"])
def test_dense_backed_view_with_changing_batch_matches_eager_or_fails_like_stock(make):
    limited = _stock_has_the_limitation(make)
    subclass_ca.reset()
    if limited:  # torch's limitation: we fail the same way (when torch fixes it, this branch stops running)
        with pytest.raises(Exception, match="non-Tensor"):
            _steps(make, lambda: subclass_ca.enable("aot_eager"))
    else:
        assert _steps(make, lambda: subclass_ca.enable("aot_eager")) == []
