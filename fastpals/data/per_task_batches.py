"""Deterministic, resumable padded batches of one task (:class:`TaskBatcher`), and :func:`merge_batches`, one
mixed padded batch of one batch per task."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from fastpals.data.mixed_batches import TaskRows
from fastpals.data.readers import Example, PairExample, SentenceExample
from fastpals.data.sampling import check_int, check_resume_settings
from fastpals.data.tasks import TaskSpec, get_task
from fastpals.data.tokenizer import Encoded, Tokenizer

PAIR_ENCODINGS = ("joint", "separate", "both")
_ORDER_SETTINGS = (
    "seed batch_size shuffle bucket_by_length bucket_size drop_last pair_encoding max_length".split()
)


def _token_counts(encodings: Sequence[Encoded]) -> np.ndarray:
    return np.array([len(enc.input_ids) for enc in encodings], dtype=np.int64)


class TaskBatcher:
    """Padded batches of one task's examples (tokenized once), in an order that is a pure function of
    ``(seed, epoch)`` (permuted, sorted by length within ``bucket_size`` batches, cut, the batches permuted).

    A batch: ``input_ids``, ``attention_mask``, ``token_type_ids`` int64 ``[B, L]``, ``labels [B]``, ``ids``,
    ``task``; ``pair_encoding="separate"`` puts sentence 2 in ``*_b``, ``"both"`` adds the joint
    ``joint_*``."""

    def __init__(
        self,
        examples: Sequence[Example],
        tokenizer: Tokenizer,
        task: str | TaskSpec,
        batch_size: int,
        *,
        max_length: int = 128,
        shuffle: bool = True,
        seed: int = 0,
        bucket_by_length: bool = True,
        bucket_size: int = 100,
        drop_last: bool = False,
        pair_encoding: str = "joint",
    ) -> None:
        self.spec = get_task(task)
        check_int("batch_size", batch_size, 1)
        check_int("bucket_size", bucket_size, 1)
        check_int("seed", seed, 0)
        if pair_encoding not in PAIR_ENCODINGS:
            raise ValueError(
                f"pair_encoding must be one of {', '.join(PAIR_ENCODINGS)}, got {pair_encoding!r}"
            )
        if pair_encoding != "joint" and not self.spec.pair:
            raise ValueError(
                f"pair_encoding={pair_encoding!r} needs a sentence-pair task, {self.spec.name!r} has single sentences"
            )
        example_type = PairExample if self.spec.pair else SentenceExample
        examples = list(examples)
        if not examples:
            raise ValueError("examples is empty")
        for i, example in enumerate(examples):
            if not isinstance(example, example_type):
                raise TypeError(
                    f"examples[{i}] is a {type(example).__name__}; task {self.spec.name!r} needs {example_type.__name__}"
                )
        with_labels = [example.label is not None for example in examples]
        if any(with_labels) and not all(with_labels):
            raise ValueError(
                f"examples mix labelled and unlabelled ones (example {with_labels.index(False)} has none)"
            )
        self.has_labels = with_labels[0]
        self.examples, self.tokenizer, self.batch_size = examples, tokenizer, batch_size
        self.max_length, self.shuffle, self.seed = max_length, shuffle, seed
        self.bucket_by_length, self.bucket_size, self.drop_last = bucket_by_length, bucket_size, drop_last
        self.pair_encoding = pair_encoding

        truncated_before = tokenizer.num_truncated
        if self.spec.pair:
            first, second = [ex.sentence1 for ex in examples], [ex.sentence2 for ex in examples]
            if pair_encoding != "separate":
                self._joint = tokenizer.encode(first, second, max_length)
            if pair_encoding != "joint":
                self._first = tokenizer.encode(first, max_length=max_length)
                self._second = tokenizer.encode(second, max_length=max_length)
        else:
            self._joint = tokenizer.encode([example.sentence for example in examples], max_length=max_length)
        self.num_truncated = tokenizer.num_truncated - truncated_before
        # lengths [N]: each example's padded width; packed_lengths [N]: its tokens once packed
        if pair_encoding == "joint":
            self.lengths = self.packed_lengths = _token_counts(self._joint)
        else:
            first, second = _token_counts(self._first), _token_counts(self._second)
            self.packed_lengths = first + second
            self.lengths = (
                np.maximum(first, second) if pair_encoding == "separate" else _token_counts(self._joint)
            )
        if self.has_labels:
            self._labels = torch.tensor([example.label for example in examples], dtype=self.spec.label_dtype)

        self.epoch, self.position = 0, 0
        self._cached: tuple[int, list[np.ndarray]] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.examples), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The example indices of every batch of ``epoch``, in order (int64 arrays)."""
        n = len(self.examples)
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        if self.bucket_by_length:
            chunk = self.bucket_size * self.batch_size
            parts = [order[start : start + chunk] for start in range(0, n, chunk)]
            order = np.concatenate([part[np.argsort(self.lengths[part], kind="stable")] for part in parts])
        batches = [order[start : start + self.batch_size] for start in range(0, n, self.batch_size)]
        if self.drop_last and len(batches[-1]) < self.batch_size:
            batches.pop()
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def collate(self, indices: Sequence[int]) -> dict:
        """The batch dict (see the class docstring) of the examples at ``indices``."""
        indices = [int(i) for i in indices]
        pad = lambda encodings: self.tokenizer.pad([encodings[i] for i in indices])
        if self.pair_encoding == "joint":
            batch: dict = dict(pad(self._joint))
        else:
            batch = dict(pad(self._first))
            batch.update((key + "_b", value) for key, value in pad(self._second).items())
            if self.pair_encoding == "both":
                batch.update(("joint_" + key, value) for key, value in pad(self._joint).items())
        if self.has_labels:
            batch["labels"] = self._labels[indices]
        batch["ids"] = [self.examples[i].id for i in indices]
        batch["task"] = self.spec.name
        return batch

    def task_rows(self, indices: Sequence[int], task: int) -> TaskRows:
        """The examples at ``indices`` as host token lists for :func:`pack_task_rows` (``task``: the model's
        index of this batcher's task); each sentence on its own unless ``pair_encoding="joint"``."""
        indices = [int(i) for i in indices]
        first = self._joint if self.pair_encoding == "joint" else self._first
        rows = TaskRows(
            task,
            [first[i].input_ids for i in indices],
            [first[i].token_type_ids for i in indices],
            labels=self._labels[indices] if self.has_labels else None,
            ids=[self.examples[i].id for i in indices],
            name=self.spec.name,
        )
        if self.pair_encoding != "joint":
            rows.input_ids_b = [self._second[i].input_ids for i in indices]
            rows.token_type_ids_b = [self._second[i].token_type_ids for i in indices]
        return rows

    def _batches_of(self, epoch: int) -> list[np.ndarray]:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self.epoch_batches(epoch))
        return self._cached[1]

    def __iter__(self) -> Iterator[dict]:
        """Yield the remaining batches of the current epoch, then move ``epoch`` on by one."""
        while self.position < len(self):
            yield self.next_batch()  # counts the batch before the yield: a state_dict now resumes after it
        self.epoch, self.position = self.epoch + 1, 0

    def next_batch(self) -> dict:
        """The next batch, going on into the next epoch when this one is used up."""
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        indices = self._batches_of(self.epoch)[self.position]
        self.position += 1
        return self.collate(indices)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch."""
        check_int("epoch", epoch, 0)
        self.epoch, self.position = epoch, 0

    def state_dict(self) -> dict:
        """``{"epoch", "position", "seed", "batch_size", "num_examples", "fingerprint", ...}`` (plain Python)."""
        return {
            "task": self.spec.name,
            "epoch": self.epoch,
            "position": self.position,
            **{key: getattr(self, key) for key in _ORDER_SETTINGS},
            "num_examples": len(self.examples),
            "fingerprint": hashlib.sha256(
                b"".join(e.id.encode("utf-8") + b"\0" for e in self.examples)
            ).hexdigest()[:16],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where ``state`` was taken; the batch order settings and examples must be the same."""
        check_resume_settings(state, self.state_dict(), "TaskBatcher", skip=("epoch", "position"))
        epoch, position = state["epoch"], state["position"]
        if not 0 <= position <= len(self):
            raise ValueError(f"position {position} is outside [0, {len(self)}]")
        self.epoch, self.position = int(epoch), int(position)


_ENCODING_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def _pad_cat(tensors: Sequence[torch.Tensor], value: int) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])


def merge_batches(batches: Sequence[dict], task_ids: Sequence[int], tokenizer: Tokenizer) -> dict:
    """One padded mixed batch of ``TaskBatcher`` batches (``task_ids[i]``: the model's index of ``batches[i]``'s
    task): int64 ``[B, L]`` tokens right-padded to the widest, ``task_ids [B]``, float32 ``labels [B]``, ``ids``,
    ``tasks``; ``*_b`` when some batch has them (``[CLS] [SEP]`` in the other rows), ``joint_*`` when all do."""
    if len(batches) == 0:
        raise ValueError("batches is empty")
    if len(task_ids) != len(batches):
        raise ValueError(f"batches has {len(batches)} entries but task_ids has {len(task_ids)}")
    pad_values = {"input_ids": tokenizer.pad_token_id, "attention_mask": 0, "token_type_ids": 0}
    sizes = [len(batch["ids"]) for batch in batches]
    merged: dict = {
        key: _pad_cat([batch[key] for batch in batches], pad_values[key]) for key in _ENCODING_KEYS
    }
    if any("input_ids_b" in batch for batch in batches):
        filler = dict(zip(_ENCODING_KEYS, ([tokenizer.cls_token_id, tokenizer.sep_token_id], [1, 1], [0, 0])))
        for key in _ENCODING_KEYS:
            parts = [
                batch.get(key + "_b", torch.tensor([filler[key]] * n)) for batch, n in zip(batches, sizes)
            ]
            merged[key + "_b"] = _pad_cat(parts, pad_values[key])
    if all("joint_input_ids" in batch for batch in batches):
        for key in _ENCODING_KEYS:
            merged["joint_" + key] = _pad_cat([batch["joint_" + key] for batch in batches], pad_values[key])
    merged["task_ids"] = torch.tensor([int(t) for t in task_ids]).repeat_interleave(torch.tensor(sizes))
    if all("labels" in batch for batch in batches):
        merged["labels"] = torch.cat([batch["labels"].to(torch.float32) for batch in batches])
    elif any("labels" in batch for batch in batches):
        raise ValueError("some batches have labels and some do not")
    merged["ids"] = [i for batch in batches for i in batch["ids"]]
    merged["tasks"] = [batch["task"] for batch, size in zip(batches, sizes) for _ in range(size)]
    return merged
