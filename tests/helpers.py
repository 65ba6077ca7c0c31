"""Small helpers shared by the tests (comparison of subclass gradients, graph capture)."""

from __future__ import annotations

from typing import Any

import torch


def inner_tensors(t: Any) -> list[torch.Tensor]:
    """All plain tensors inside ``t``, recursively through ``__tensor_flatten__`` (non-tensors skipped)."""
    if t is None:
        return []
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    out: list[torch.Tensor] = []
    for name in names:
        value = getattr(t, name)
        if isinstance(value, torch.Tensor):
            out += inner_tensors(value)
    return out


def assert_same_grad(expected: Any, actual: Any, *, exact: bool = True) -> None:
    """Same type, same outer metadata and same inner tensors (bitwise when ``exact``)."""
    assert type(actual) is type(expected), f"grad type {type(actual).__name__} != eager {type(expected).__name__}"
    if expected is None:
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype and actual.device == expected.device
    # not exact: inductor reassociates float sums; over several optimizer steps that reaches ~1e-5
    tolerance = {"atol": 0, "rtol": 0} if exact else {"atol": 1e-4, "rtol": 1e-4}
    expected_parts, actual_parts = inner_tensors(expected), inner_tensors(actual)
    assert len(expected_parts) == len(actual_parts)
    for want, got in zip(expected_parts, actual_parts):
        torch.testing.assert_close(got, want, **tolerance)


class GraphRecorder:
    """A torch.compile backend callable that records the graphs Dynamo hands it."""

    def __init__(self, backend: str = "aot_eager") -> None:
        self.backend = backend
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs.append(gm)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.backend)(gm, example_inputs)


def _torch_before_2_13() -> bool:
    from subclass_ca._compat.version import parse_torch_version

    return parse_torch_version(torch.__version__)[:2] < (2, 13)


#: Known, unfixed on torch 2.11/2.12 (docs/versions.md lists each): strict, so each reports the day it passes.
KNOWN_ON_TORCH_BEFORE_2_13 = _torch_before_2_13()
