"""A Pytorch-PCGrad-semantics reference, written here from its published algorithm (for the benchmark only).

What it reproduces, step for step (so that its time and memory are what users of that package pay):

1. one backward per task on the shared graph (``retain_graph=True`` every time), zeroing the gradients before
   each, then for every optimizer parameter a clone of its gradient (zeros when it has none) and a same-sized
   "has gradient" mask of ones or zeros; both are flattened per task (``T`` flat gradients and ``T`` flat masks);
2. for each task's copy, the list of all task gradients (itself included) is shuffled in place with Python's
   ``random`` and the copy is projected against every original ``g_j`` it conflicts with, the test
   ``dot < 0`` being evaluated on the host (one device sync per pair);
3. the merge quirk: elements that every task touched are AVERAGED over the tasks (its ``reduction='sum'`` branch
   is unreachable), the other elements summed; dot products run over all parameters, heads included;
4. every parameter gets a gradient, parameters no task used get zeros (so weight decay and momentum move them).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

__all__ = ["ReferencePCGrad"]


class ReferencePCGrad:
    """``ReferencePCGrad(optimizer, seed)``: ``pc_backward(losses)``, ``step()``, ``zero_grad()``."""

    def __init__(self, optimizer: torch.optim.Optimizer, seed: int = 0) -> None:
        self.optimizer = optimizer
        self.rng = random.Random(seed)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.optimizer.step()

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _collect(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        grads, masks = [], []
        for p in self._params():
            if p.grad is None:
                grads.append(torch.zeros_like(p).reshape(-1))
                masks.append(torch.zeros_like(p).reshape(-1))
            else:
                grads.append(p.grad.clone().reshape(-1))
                masks.append(torch.ones_like(p).reshape(-1))
        return grads, masks

    def pc_backward(self, losses: Sequence[torch.Tensor]) -> None:
        flat_grads, flat_masks = [], []
        for loss in losses:
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward(retain_graph=True)
            grads, masks = self._collect()
            flat_grads.append(torch.cat(grads))
            flat_masks.append(torch.cat(masks))
        shared = torch.stack(flat_masks).prod(dim=0).bool()
        projected = [g.clone() for g in flat_grads]
        order = list(flat_grads)
        for g_i in projected:
            self.rng.shuffle(order)
            for g_j in order:
                dot = torch.dot(g_i, g_j)
                if dot < 0:  # host sync
                    g_i -= dot * g_j / (g_j.norm() ** 2)
        merged = torch.zeros_like(flat_grads[0])
        stacked = torch.stack(projected)
        merged[shared] = stacked[:, shared].mean(dim=0)
        merged[~shared] = stacked[:, ~shared].sum(dim=0)
        offset = 0
        for p in self._params():
            n = p.numel()
            p.grad = merged[offset : offset + n].view_as(p).clone()
            offset += n
