"""The data of a run: tokenizer, train and dev batchers, the updates' sampler; rank ``r`` of ``W`` trains on
examples ``r, r + W, ...``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from fastpals.data.per_task_batches import TaskBatcher
from fastpals.data.sampling import TaskSampler
from fastpals.data.tokenizer import Tokenizer
from fastpals.model import evaluate as ev
from fastpals.train.args import TrainArgs
from fastpals.train.errors import ConfigError
from fastpals.train.mixed import MixedUpdates

__all__ = ["open_tokenizer", "RunData", "eval_batcher", "setup_data"]


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
    steps = args.steps_per_epoch
    if steps is None and args.sampling != "round_robin":
        steps = 2400
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
