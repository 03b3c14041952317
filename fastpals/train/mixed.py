"""``--batching mixed``: every micro-batch mixes the tasks, packed without padding. :class:`MixedUpdates`
draws each micro-batch's examples (``--batch-size`` examples or ``--max-tokens`` tokens) and
:func:`packed_micro_batches` collates them for :func:`fastpals.train.step.run_update`. An epoch is
``--steps-per-epoch`` updates, else about one pass over the training examples."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fastpals.data.mixed_batches import MixedBatchSampler, MixedSelection, collate_packed, model_inputs
from fastpals.data.per_task_batches import TaskBatcher
from fastpals.train.step import MicroBatch

__all__ = ["MixedUpdates", "packed_micro_batches"]


class MixedUpdates:
    """The update stream of ``--batching mixed``, with a ``TaskSampler``'s interface: an update is
    ``micro_per_update`` selections; epochs and state are its ``sampler``'s."""

    def __init__(
        self,
        batchers: Sequence[TaskBatcher],
        method: str,
        num_epochs: int,
        batch_size: int | None,
        max_tokens: int | None,
        micro_per_update: int,
        updates_per_epoch: int | None,
        seed: int,
        world_size: int = 1,
    ) -> None:
        self.micro_per_update = micro_per_update
        # about one pass over the data (the smallest shard's, identical on ranks)
        if updates_per_epoch is None:
            sizes = [len(b.examples) for b in batchers]
            if batch_size is not None:
                micro = math.ceil(sum(sizes) / batch_size)
            else:
                micro = math.ceil(sum(int(np.sum(b.packed_lengths)) for b in batchers) / max_tokens)
            updates_per_epoch = max(1, micro // micro_per_update)
            if world_size > 1:  # every rank must run the same number of updates
                count = torch.tensor([updates_per_epoch])
                dist.all_reduce(count, op=dist.ReduceOp.MIN)
                updates_per_epoch = int(count)
        self.updates_per_epoch = updates_per_epoch
        self.sampler = MixedBatchSampler.from_batchers(
            batchers, method, num_epochs, batch_size=batch_size, max_tokens=max_tokens,
            micro_batches_per_epoch=updates_per_epoch * micro_per_update, seed=seed,
        )  # fmt: skip

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def epoch_done(self) -> bool:
        return self.sampler.epoch_done()

    def start_next_epoch(self) -> None:
        self.sampler.start_next_epoch()

    def next_update(self) -> list[MixedSelection]:
        return [self.sampler.next_micro_batch() for _ in range(self.micro_per_update)]

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def packed_micro_batches(
    batchers: Sequence[TaskBatcher],
    selections: Sequence[MixedSelection],
    device: torch.device | str,
    weighting: str,
) -> Iterator[MicroBatch]:
    """The update's packed mixed micro-batches, collated one at a time as ``run_update`` consumes
    them (``batchers``: one per task in the model's order; ``weighting``: ``--task-weighting``), with host counts of
    each task's examples and tokens."""
    for sel in selections:
        batch = collate_packed(batchers, sel)
        tasks = tuple(t for t, idx in enumerate(sel.indices) if len(idx))
        yield MicroBatch(
            inputs=model_inputs(batch, device), labels=batch["labels"].to(device), tasks=tasks,
            examples=tuple(len(sel.indices[t]) for t in tasks),
            tokens=tuple(int(batchers[t].packed_lengths[sel.indices[t]].sum()) for t in tasks),
            weighting=weighting,
        )  # fmt: skip
