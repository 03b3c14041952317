"""The data of a run: tokenizer, train and dev batchers, the updates' sampler (rank ``r`` of ``W`` trains on
examples ``r, r + W, ...``), and ``--batching mixed``'s updates, whose micro-batches mix the tasks, packed."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fastpals.data.mixed_batches import MixedBatchSampler, MixedSelection, collate_packed, model_inputs
from fastpals.data.per_task_batches import TaskBatcher
from fastpals.data.sampling import TaskSampler
from fastpals.data.tokenizer import Tokenizer
from fastpals.model import evaluate as ev
from fastpals.train.args import TrainArgs
from fastpals.train.errors import ConfigError
from fastpals.train.step import MicroBatch

__all__ = ["MixedUpdates", "RunData", "eval_batcher", "open_tokenizer", "packed_micro_batches", "setup_data"]


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
            if batch_size is not None:
                micro = math.ceil(sum(len(b.examples) for b in batchers) / batch_size)
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
    them (``batchers``: one per task in the model's order; ``weighting``: ``--task-weighting``), with host
    counts of each task's examples and tokens."""
    for sel in selections:
        batch = collate_packed(batchers, sel)
        tasks = tuple(t for t, idx in enumerate(sel.indices) if len(idx))
        yield MicroBatch(
            inputs=model_inputs(batch, device), labels=batch["labels"].to(device), tasks=tasks,
            examples=tuple(len(sel.indices[t]) for t in tasks),
            tokens=tuple(int(batchers[t].packed_lengths[sel.indices[t]].sum()) for t in tasks),
            weighting=weighting,
        )  # fmt: skip


@dataclass
class RunData:
    """What :func:`setup_data` builds: ``pair_encoding[task]`` is ``"joint"`` or ``"separate"`` (siamese pairs);
    ``train_sizes[i]``: training examples of task ``i`` before sharding; ``total_updates``: over all epochs."""

    tokenizer: Tokenizer
    pair_encoding: dict[str, str]
    train_batchers: dict[str, TaskBatcher]
    dev_batchers: dict[str, TaskBatcher]
    train_sizes: list[int]
    sampler: TaskSampler | MixedUpdates
    total_updates: int


def open_tokenizer(args: TrainArgs) -> Tokenizer:
    """The tokenizer of ``--model``; :class:`ConfigError` (one line) when it has no usable one."""
    try:
        return Tokenizer.from_pretrained(args.model)
    except (FileNotFoundError, OSError, ImportError, ValueError) as err:
        raise ConfigError(f"--model {args.model}: {err}") from None


def setup_data(
    args: TrainArgs,
    rank: int,
    world_size: int,
    log: Callable[[str], None],
    tokenizer: Tokenizer | None = None,
) -> RunData:
    """The :class:`RunData` of ``args`` on process ``rank`` of ``world_size``; ``log`` gets a summary line."""
    tokenizer = open_tokenizer(args) if tokenizer is None else tokenizer
    pair_encoding = {
        t: "joint" if (args.pair_mode == "joint" or not args.task_specs[t].pair) else "separate"
        for t in args.task_list
    }
    train_batchers: dict[str, TaskBatcher] = {}
    dev_batchers: dict[str, TaskBatcher] = {}
    train_sizes: list[int] = []
    said: set[str] = set()

    def log_once(line: str) -> None:  # train and dev read from one file (Quora) report its skipped rows once
        message = line.split(": ", 1)[-1] if line.startswith("[data] ") else line
        if message not in said:
            said.add(message)
            log(line)

    for i, t in enumerate(args.task_list):
        train = ev.load_split(args.task_specs[t], "train", args.data_path, args.max_train, log_once)
        train_sizes.append(len(train))
        shard = train[rank::world_size] if world_size > 1 else train
        train_batchers[t] = TaskBatcher(
            shard, tokenizer, args.task_specs[t], args.batch_size, max_length=args.max_length, shuffle=True,
            seed=args.seed * 1000 + i, pair_encoding=pair_encoding[t],
        )  # fmt: skip
        dev_batchers[t] = eval_batcher(
            args, tokenizer, pair_encoding, t, "dev", args.max_eval, log_once, sample=True
        )
    # identical on every rank: batches of the smallest shard
    batches = [math.ceil((n // world_size) / args.batch_size) or 1 for n in train_sizes]
    steps = args.steps_per_epoch or (None if args.sampling == "round_robin" else 2400)
    sampler: TaskSampler | MixedUpdates
    if args.batching == "mixed":
        sampler = MixedUpdates(
            list(train_batchers.values()), args.sampling, args.epochs,
            None if args.max_tokens else args.batch_size, args.max_tokens, args.grad_accum,
            args.steps_per_epoch, args.seed, world_size,
        )  # fmt: skip
    else:
        sampler = TaskSampler(
            args.sampling, train_sizes, batches, args.epochs, steps,
            micro_batches_per_update=args.grad_accum if args.surgery == "none" else len(args.task_list),
            extra=args.extra_batches, seed=args.seed,
        )  # fmt: skip
    total_updates = sampler.updates_per_epoch * args.epochs
    sizes = ", ".join(f"{t} {n}" for t, n in zip(args.task_list, train_sizes))
    log_once(
        f"[data] train examples: {sizes}; {sampler.updates_per_epoch} updates/epoch x {args.epochs} "
        f"epochs, sampling {args.sampling}, {args.batching} batches; dev: "
        + ", ".join(f"{t} {len(b.examples)}" for t, b in dev_batchers.items())
        + (" (para dev = held-out 10% hash split of quora-dev.csv)" if "para" in args.task_list else "")
    )
    return RunData(
        tokenizer, pair_encoding, train_batchers, dev_batchers, train_sizes, sampler, total_updates
    )


def eval_batcher(
    args: TrainArgs,
    tokenizer: Tokenizer,
    pair_encoding: dict[str, str],
    task: str,
    split: str,
    limit: int | None,
    log: Callable[[str], None],
    sample: bool = False,
) -> TaskBatcher:
    """The in-order batcher of ``split`` of ``task``: at most ``limit`` examples (a fixed random subset with
    ``sample``, else the first ones), batches of ``max(--batch-size, EVAL_BATCH)``."""
    spec = args.task_specs[task]
    examples = ev.load_split(spec, split, args.data_path, limit, log, sample=sample)
    return TaskBatcher(
        examples, tokenizer, spec, max(args.batch_size, ev.EVAL_BATCH),
        max_length=args.max_length, shuffle=False, bucket_by_length=False,
        pair_encoding=pair_encoding[task],
    )  # fmt: skip
