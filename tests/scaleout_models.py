"""A tiny torch module for the scale-out tests: GPU node hosts (Ray actors or in-process) load it
by its import path, as a config's ``options.factory`` names it."""
from __future__ import annotations

import torch


class TinyScorer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.lin = torch.nn.Linear(3, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        return self.lin(x)


def reference(xs):
    return TinyScorer().lin(torch.tensor(xs))[:, 0].tolist()
