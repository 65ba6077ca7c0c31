"""The reference zoo behaves like the tensors it stands for under torch's own API (mypy's override checks found these)."""

from __future__ import annotations

import pytest
import torch

from subclass_ca.testing.subclasses import ChunkedTensor, make_chunked, make_int8, make_tagged


def test_torch_split_of_a_chunked_tensor_splits_its_value():
    """``ChunkedTensor.split`` was a classmethod (dense -> halves) shadowing ``Tensor.split``: torch.split raised."""
    dense = torch.randn(6, 3)
    pieces = torch.split(make_chunked(dense), 2)
    assert [tuple(p.shape) for p in pieces] == [(2, 3)] * 3
    for piece, want in zip(pieces, torch.split(dense, 2)):
        got = piece.to_dense() if isinstance(piece, ChunkedTensor) else piece
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_chunked_tensor_halve_keeps_the_odd_row_on_top():
    chunked = ChunkedTensor.halve(torch.arange(5.0).reshape(5, 1))
    assert tuple(chunked.top.shape) == (3, 1) and tuple(chunked.bottom.shape) == (2, 1)


@pytest.mark.parametrize("make", [make_chunked, make_int8, make_tagged], ids=["chunked", "int8", "tagged"])
def test_to_dense_takes_tensor_to_dense_s_dtype(make):
    """``to_dense(dtype)`` is ``Tensor.to_dense``'s signature; the zoo's took no arguments (TypeError)."""
    zoo = make(torch.randn(4, 4))
    dense = zoo.to_dense()
    assert dense.dtype == torch.float32
    converted = zoo.to_dense(torch.float64)
    assert converted.dtype == torch.float64
    torch.testing.assert_close(converted, dense.double(), rtol=0, atol=0)
