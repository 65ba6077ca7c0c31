"""Models shared by the beyond-stock regression files."""

from __future__ import annotations

import torch

from subclass_ca import _compat

TwoTensor = _compat.two_tensor_type()


class PairThenLinear(torch.nn.Module):
    """A TwoTensor weight followed by a plain Linear: the Linear's grads become TwoTensors."""

    def __init__(self) -> None:
        super().__init__()
        dense = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
        self.w = torch.nn.Parameter(TwoTensor(dense.clone(), dense * 2.0))
        self.lin = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))
            self.lin.bias.copy_(torch.randn(3, generator=torch.Generator().manual_seed(2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x @ self.w).sin().sum()
