"""Mixed-task micro-batches, packed without padding.

A *mixed* micro-batch holds examples of every task, in shares that follow the sampling scheme, and its rows are
concatenated without padding (``cu_seqlens``/``max_seqlen``, the layout of flash-attn's varlen kernels), so one
forward pass serves all tasks and no op computes on padding tokens.

Sampling (:class:`MixedBatchSampler`)
-------------------------------------
``p_t`` = the share of task ``t`` in each micro-batch (``N_t`` = training examples of task ``t``):

* ``annealed``: ``p_t ∝ N_t^α(e)`` with :func:`fastpals.sampling.annealed_alpha` (α = 1 in the first epoch, 0.2 in
  the last); ``proportional``, ``uniform``, ``sqrt``: :func:`fastpals.sampling.task_probabilities`;
* ``round_robin``, ``random_round_robin``, ``every_task_plus_annealed``: equal shares ``1/T``.

With ``batch_size`` B, task t gets ``floor(B p_t)`` examples plus one more with probability equal to the
fractional part of ``B p_t`` (systematic sampling: one uniform draw per micro-batch), so the counts sum to B and
their expectation is exactly ``B p_t``. With ``max_tokens`` (fairseq's token budget), tasks take turns by smooth
weighted round robin (credit ``c_t += p_t`` per pick, the largest credit picks and pays 1; credits start at
uniform random offsets each micro-batch), each pick taking that task's next example, until the next example would
exceed the budget; rows are never split, and a row longer than the budget is an error naming ``--max-tokens``.
Both limits may be given (then at most ``batch_size`` examples and ``max_tokens`` tokens).

Each task walks through its own permutation of its examples: pass ``k`` (from 0) of task t is
``numpy.random.default_rng([task_seed_t, k]).permutation(N_t)``, the first step of
:meth:`fastpals.data.TaskBatcher.epoch_batches` with the batcher's seed; a task that runs out starts its next
pass. Everything is a function of the seeds; ``state_dict()`` holds ``(epoch, step)``, every task's
``(pass, position)`` and the generator's state, so a resumed run draws exactly the micro-batches an uninterrupted
one would.

Packing (:func:`pack_batches`, :func:`collate_packed`)
------------------------------------------------------
A packed micro-batch is a dict:

* ``input_ids``, ``token_type_ids``: int64 ``[N]``, the ``B`` rows back to back (joint pair tasks as
  ``[CLS] a [SEP] b [SEP]``, token types 0/1); ``cu_seqlens``: int32 ``[B+1]``; ``max_seqlen``: int.
* ``task_ids``: int64 ``[B]``, grouped by task in increasing order; ``labels``: float32 ``[B]`` (when labelled);
  ``ids``: ``list[str]``; ``tasks``: the task name of every row.
* siamese pair tasks (``pair_mode`` sbert_*, batches with ``*_b`` keys): their second sentences, as separate
  sequences ``input_ids_b``, ``token_type_ids_b`` ``[N2]``, ``cu_seqlens_b`` ``[B2+1]``, ``max_seqlen_b``, one per
  siamese row in row order (``B2`` = siamese rows; other rows have none).
* ``task_examples``, ``task_tokens``: int64 ``[T]``: examples and tokens (both sentences) of each task;
  ``num_tokens``: int, ``N + N2``.

:func:`model_inputs` picks the keys ``MultiTaskBert.forward`` takes. The pad/unpad/``cu_seqlens`` helpers of the
package live here (:func:`lengths_to_cu_seqlens`, :func:`cu_seqlens_to_mask`, :func:`unpad`, :func:`pad_packed`,
:func:`packed_position_ids`, :func:`pool_packed`). Without a varlen attention kernel (CPU, or CUDA without
flash-attn / in fp32) the model attends over blocks of sequences of similar length (:func:`attention_plan`,
:func:`bucketed_attention`), so packing does not bring back padding through attention.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fastpals.sampling import SAMPLING_METHODS, check_resume_settings, next_epoch, task_probabilities

if TYPE_CHECKING:
    from fastpals.data import TaskBatcher

__all__ = [
    "EQUAL_SHARE_METHODS",
    "AttentionBucket",
    "AttentionPlan",
    "MixedBatchSampler",
    "MixedSelection",
    "attention_plan",
    "bucketed_attention",
    "check_packed",
    "collate_packed",
    "cu_seqlens_to_mask",
    "lengths_to_cu_seqlens",
    "model_inputs",
    "pack_batches",
    "packed_position_ids",
    "pad_packed",
    "padding_fraction",
    "pool_packed",
    "share_counts",
    "unpad",
]

EQUAL_SHARE_METHODS = ("round_robin", "random_round_robin", "every_task_plus_annealed")


# ----------------------------------------------------------------------------------------------------------------
# cu_seqlens helpers (the one place the package builds and reads packed layouts)
# ----------------------------------------------------------------------------------------------------------------
def lengths_to_cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    """Sequence lengths ``[B]`` (int) → ``cu_seqlens [B+1]`` int32 (0, then the running sums)."""
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, 0)
    return cu


def cu_seqlens_to_mask(cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """``cu_seqlens [B+1]`` → right-padded mask ``[B, max_seqlen]`` bool (True = token)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.arange(max_seqlen, device=cu_seqlens.device)[None, :] < lengths[:, None]


def packed_position_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every packed token inside its own sequence: int64 ``[N]`` (``N = total = cu_seqlens[-1]``)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = cu_seqlens[:-1].long().repeat_interleave(lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


def unpad(x: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Right-padded ``x [B, L, ...]`` with ``attention_mask [B, L]`` (1 = token) → ``(packed [N, ...],
    cu_seqlens [B+1] int32, max_seqlen)``. Raises ``ValueError`` if a mask row is not ``1...1 0...0``."""
    mask = attention_mask.to(torch.bool)
    lengths = mask.sum(1)
    if not torch.equal(mask, torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]):
        raise ValueError("attention_mask rows must be right-padded (1...1 0...0) to be packed")
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    return x[mask], lengths_to_cu_seqlens(lengths), max_seqlen


def pad_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, value: float = 0) -> torch.Tensor:
    """Packed ``x [N, ...]`` → right-padded ``[B, max_seqlen, ...]`` filled with ``value`` (inverse of :func:`unpad`)."""
    mask = cu_seqlens_to_mask(cu_seqlens, max_seqlen)
    out = x.new_full((mask.shape[0], max_seqlen, *x.shape[1:]), value)
    out[mask] = x
    return out


def check_packed(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None, max_positions: int
) -> torch.Tensor:
    """Validate a packed batch and return its lengths ``[B]`` int64 (one host sync).

    ``input_ids [N]``; ``cu_seqlens [B+1]`` int32 on the same device, starting at 0, ending at N, every sequence
    at least one token; ``max_seqlen`` an int >= the longest sequence and <= ``max_positions``.
    """
    if input_ids.dim() != 1:
        raise ValueError(
            f"packed input_ids must be [N] (cu_seqlens given), got shape {list(input_ids.shape)}"
        )
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must be a 1-D tensor [B+1] with B >= 1")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32 (flash-attn's layout), got {cu_seqlens.dtype}")
    if cu_seqlens.device != input_ids.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but input_ids on {input_ids.device}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
        raise TypeError(f"max_seqlen must be an int with packed inputs, got {max_seqlen!r}")
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    first, last, shortest, longest = (
        int(v) for v in (cu_seqlens[0], cu_seqlens[-1], lengths.min(), lengths.max())
    )
    if first != 0 or last != input_ids.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to N = {input_ids.shape[0]}, got {first} .. {last}")
    if shortest < 1:
        raise ValueError("cu_seqlens holds an empty sequence: every packed sequence needs at least one token")
    if not longest <= max_seqlen <= max_positions:
        raise ValueError(
            f"max_seqlen {max_seqlen} must be >= the longest sequence ({longest}) and <= {max_positions}"
        )
    return lengths


def pool_packed(hidden: torch.Tensor, cu_seqlens: torch.Tensor, mode: str) -> torch.Tensor:
    """Pool packed token states ``hidden [N, d]`` per sequence → ``[B, d]`` (same dtype).

    ``mode``: ``"first"`` (the [CLS] token), ``"mean"`` (over the sequence's tokens) or ``"max"`` (element-wise).
    Equals the masked pooling of the padded batch.
    """
    starts = cu_seqlens[:-1].long()
    if mode == "first":
        return hidden.index_select(0, starts)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(torch.arange(lengths.shape[0], device=hidden.device), lengths)
    index = segment[:, None].expand_as(hidden)
    if mode == "mean":
        total = hidden.new_zeros(lengths.shape[0], hidden.shape[1]).index_add(0, segment, hidden)
        return total / lengths.clamp_min(1).to(hidden.dtype)[:, None]
    if mode == "max":
        init = hidden.new_full((lengths.shape[0], hidden.shape[1]), torch.finfo(hidden.dtype).min)
        return init.scatter_reduce(0, index, hidden, reduce="amax", include_self=False)
    raise ValueError(f"pooling mode {mode!r}: choose first, mean or max")


@dataclass(frozen=True)
class AttentionBucket:
    """Sequences of similar length attended together in one padded block ``[size, length]``.

    ``mask [size, length]`` bool (True = token); where each token lands is the plan's ``slots``.
    """

    mask: torch.Tensor
    size: int
    length: int

    @functools.cached_property
    def key_bias(self) -> torch.Tensor:
        """The block's additive fp32 key bias ``[size, 1, 1, length]`` (:func:`fastpals.functional.key_mask_bias`),
        built on first use and shared by every layer that attends over this block."""
        from fastpals.functional import key_mask_bias

        return key_mask_bias(self.mask, torch.float32)


@dataclass(frozen=True)
class AttentionPlan:
    """How :func:`bucketed_attention` splits a packed batch: ``buckets``, laid out back to back in one padded
    buffer of ``sum(size * length)`` slots, and ``slots [N]`` int64: the buffer slot of every packed token."""

    buckets: list[AttentionBucket]
    slots: torch.Tensor


def attention_plan(cu_seqlens: torch.Tensor, ratio: float = 0.5) -> AttentionPlan:
    """Group the sequences of ``cu_seqlens [B+1]`` by length for attention over padded blocks (the CPU path):
    sorted longest first, a sequence joins the current block while its length is at least ``ratio`` times the
    block's longest, so at most ``1 - ratio`` of a block's query rows (and keys) are padding.

    The ratio trades padding against per-block overhead: on ``make train``'s batches (32 rows of 5-69 tokens,
    MiniLM on 2 CPU cores), paired on the same batches, 0.5 made the update 0.87x as long as 0.8; 0.65 gave
    0.94x and 0.35 1.03x."""
    cu = cu_seqlens.detach().to("cpu", torch.int64).numpy()
    lengths = cu[1:] - cu[:-1]
    order = np.argsort(-lengths, kind="stable")
    groups: list[list[int]] = []
    for s in order:
        if groups and lengths[s] >= ratio * lengths[groups[-1][0]]:
            groups[-1].append(int(s))
        else:
            groups.append([int(s)])
    device = cu_seqlens.device
    buckets = []
    slots = np.empty(int(cu[-1]), dtype=np.int64)
    offset = 0
    for group in groups:
        length = int(lengths[group[0]])
        tokens = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in group])
        local = np.concatenate([j * length + np.arange(lengths[s]) for j, s in enumerate(group)])
        slots[tokens] = offset + local
        offset += len(group) * length
        mask = np.arange(length)[None, :] < lengths[group][:, None]
        buckets.append(
            AttentionBucket(mask=torch.from_numpy(mask).to(device), size=len(group), length=length)
        )
    return AttentionPlan(buckets=buckets, slots=torch.from_numpy(slots).to(device))


def bucketed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: AttentionPlan,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBucket], torch.Tensor],
) -> torch.Tensor:
    """Packed attention computed block by block: ``q, k, v [N, H, Dh]`` → ``[N, H, Dh]``.

    ``attend(q, k, v, bucket)`` is padded attention on ``[size, length, H, Dh]`` with the bucket's key mask
    (``bucket.mask [size, length]`` bool, or its cached fp32 ``bucket.key_bias``; e.g.
    :func:`fastpals.functional.attention_with_key_bias`); each sequence only sees its own keys, as in
    :func:`fastpals.functional.attention_varlen_reference`, with padding bounded per block instead of padding
    every sequence to the batch's longest. The tokens enter one padded buffer holding every block with one
    scatter and leave it with one gather (``plan.slots``), so the backward adds no per-block full-size gradients.
    """
    qkv = torch.stack((q, k, v), 1)  # [N, 3, H, Dh]
    sizes = [b.size * b.length for b in plan.buckets]
    padded = qkv.new_zeros(sum(sizes), *qkv.shape[1:]).index_copy(0, plan.slots, qkv)
    pieces = []
    for b, block in zip(plan.buckets, padded.split(sizes)):
        qb, kb, vb = block.view(b.size, b.length, *qkv.shape[1:]).unbind(2)
        ctx = attend(qb, kb, vb, b)
        pieces.append(ctx.reshape(b.size * b.length, *ctx.shape[2:]))
    return torch.cat(pieces).index_select(0, plan.slots)


def padding_fraction(batch: dict) -> float:
    """Fraction of the token slots a batch dict makes the model compute that are padding: 0.0 for a packed batch
    (``cu_seqlens``), ``1 - tokens / (B * L)`` over ``attention_mask`` (and ``attention_mask_b``) for a padded one."""
    if "cu_seqlens" in batch:
        return 0.0
    slots = tokens = 0
    for key in ("attention_mask", "attention_mask_b"):
        if key in batch:
            slots += batch[key].numel()
            tokens += int(batch[key].sum())
    return 1.0 - tokens / slots if slots else 0.0


# ----------------------------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------------------------
def share_counts(total: int, probabilities: np.ndarray, u: float) -> np.ndarray:
    """Integer counts summing to ``total`` with expectation ``total * p`` (systematic rounding).

    Each task gets ``floor(total p_t)`` plus 1 when one of the points ``u, u+1, u+2, ...`` falls in its slice of
    the cumulative fractional parts; ``u`` in [0, 1) (one uniform draw). Returns int64 ``[T]``.
    """
    exact = total * np.asarray(probabilities, dtype=np.float64)
    base = np.floor(exact)
    cum = np.concatenate([[0.0], np.cumsum(exact - base)])
    extra = np.floor(cum[1:] - u + 1e-9) - np.floor(cum[:-1] - u + 1e-9)
    counts = (base + extra).astype(np.int64)
    short = total - int(counts.sum())  # rounding of the cumulative sum can leave at most one point out
    if short:
        counts[int(np.argmax(exact - base))] += short
    return counts


@dataclass
class MixedSelection:
    """One mixed micro-batch: ``indices[t]`` int64 array of task t's example indices (maybe empty), with the
    ``epoch`` (from 1) and ``step`` (from 0, within the epoch) it was drawn at."""

    indices: list[np.ndarray]
    epoch: int
    step: int

    @property
    def counts(self) -> list[int]:
        """Examples per task."""
        return [len(i) for i in self.indices]


class MixedBatchSampler:
    """A resumable stream of mixed-task micro-batches (example indices per task); see the module docstring.

    Args:
        lengths: per task, the packed token count of every example (``[N_t]`` ints: the joint encoding's length,
            or both sentences' for siamese pairs; :attr:`fastpals.data.TaskBatcher.packed_lengths`).
        method: a :data:`fastpals.sampling.SAMPLING_METHODS` name (sets the shares).
        num_epochs: ``E`` (the annealing schedule depends on it).
        batch_size: examples per micro-batch, and/or
        max_tokens: tokens per micro-batch (rows never split; an example above it is an error).
        micro_batches_per_epoch: micro-batches in an epoch (default: ``ceil(sum N_t / batch_size)``, or with
            ``max_tokens`` alone ``ceil(sum of all lengths / max_tokens)``, i.e. about one pass over the data).
        seed: non-negative int, seeds the share draws.
        task_seeds: per task, the seed of its example permutations (default ``seed * 1000 + t``, the trainer's
            batcher seeds).
        task_names: for error messages (default ``task0``, ``task1``, ...).
    """

    def __init__(
        self,
        lengths: Sequence[Sequence[int] | np.ndarray],
        method: str,
        num_epochs: int,
        *,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        micro_batches_per_epoch: int | None = None,
        seed: int = 0,
        task_seeds: Sequence[int] | None = None,
        task_names: Sequence[str] | None = None,
    ) -> None:
        if method not in SAMPLING_METHODS:
            raise ValueError(f"sampling method {method!r}: choose one of {', '.join(SAMPLING_METHODS)}")
        self.lengths = [np.asarray(x, dtype=np.int64) for x in lengths]
        if not self.lengths or any(x.ndim != 1 or x.size == 0 for x in self.lengths):
            raise ValueError("lengths must hold, for each task, a non-empty 1-D sequence of token counts")
        if any(int(x.min()) < 1 for x in self.lengths):
            raise ValueError("lengths must be positive token counts")
        t = len(self.lengths)
        self.task_names = list(task_names) if task_names is not None else [f"task{i}" for i in range(t)]
        if len(self.task_names) != t:
            raise ValueError(f"task_names has {len(self.task_names)} entries for {t} tasks")
        for name, value, low in (("num_epochs", num_epochs, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if batch_size is None and max_tokens is None:
            raise ValueError("give batch_size (--batch-size) or max_tokens (--max-tokens)")
        for name, value in (("--batch-size", batch_size), ("--max-tokens", max_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if max_tokens is not None:
            longest = max(int(x.max()) for x in self.lengths)
            for name, x in zip(self.task_names, self.lengths):
                if int(x.max()) > max_tokens:
                    i = int(np.argmax(x))
                    raise ValueError(
                        f"--max-tokens {max_tokens} is less than example {i} of task {name} ({int(x[i])} tokens): "
                        f"raise --max-tokens to at least {longest} or lower --max-length"
                    )
        self.task_seeds = (
            [int(s) for s in task_seeds] if task_seeds is not None else [seed * 1000 + i for i in range(t)]
        )
        if len(self.task_seeds) != t or any(s < 0 for s in self.task_seeds):
            raise ValueError(f"task_seeds must hold {t} non-negative ints, got {task_seeds!r}")
        self.method = method
        self.num_tasks = t
        self.sizes = [int(x.size) for x in self.lengths]
        self.num_epochs = num_epochs
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.seed = seed
        if micro_batches_per_epoch is None:
            if batch_size is not None:
                micro_batches_per_epoch = math.ceil(sum(self.sizes) / batch_size)
            else:
                micro_batches_per_epoch = math.ceil(sum(int(x.sum()) for x in self.lengths) / max_tokens)
        if (
            isinstance(micro_batches_per_epoch, bool)
            or not isinstance(micro_batches_per_epoch, int)
            or micro_batches_per_epoch < 1
        ):
            raise ValueError(f"micro_batches_per_epoch must be an int >= 1, got {micro_batches_per_epoch!r}")
        self.micro_batches_per_epoch = micro_batches_per_epoch
        self.epoch = 1
        self.step = 0
        self.passes = [0] * t
        self.positions = [0] * t
        self._rng = np.random.default_rng(seed)
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    @classmethod
    def from_batchers(
        cls, batchers: Sequence[TaskBatcher], method: str, num_epochs: int, **kwargs: Any
    ) -> MixedBatchSampler:
        """A sampler over the examples of ``batchers`` (one per task, in the model's task order): lengths from
        their ``packed_lengths``, permutation seeds from their ``seed``; ``kwargs`` as for the constructor."""
        kwargs.setdefault("task_seeds", [b.seed for b in batchers])
        kwargs.setdefault("task_names", [b.spec.name for b in batchers])
        return cls([b.packed_lengths for b in batchers], method, num_epochs, **kwargs)

    # ------------------------------------------------------------------------------------------------------------
    def probabilities(self, epoch: int | None = None) -> np.ndarray:
        """Per-task shares ``[T]`` float64 in ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self.method in EQUAL_SHARE_METHODS:
            return np.full(self.num_tasks, 1.0 / self.num_tasks)
        return task_probabilities(self.sizes, self.method, epoch, self.num_epochs)

    def pass_order(self, task: int, k: int) -> np.ndarray:
        """The example order of pass ``k`` (from 0) over task ``task``: int64 ``[N_t]``, the same permutation as
        :meth:`fastpals.data.TaskBatcher.epoch_batches` starts epoch ``k`` with (given the batcher's seed)."""
        return np.random.default_rng([self.task_seeds[task], k]).permutation(self.sizes[task])

    def _perm(self, t: int) -> np.ndarray:
        cached = self._perms.get(t)
        if cached is None or cached[0] != self.passes[t]:
            cached = (self.passes[t], self.pass_order(t, self.passes[t]))
            self._perms[t] = cached
        return cached[1]

    def _peek(self, t: int) -> int:
        if self.positions[t] >= self.sizes[t]:
            self.passes[t] += 1
            self.positions[t] = 0
        return int(self._perm(t)[self.positions[t]])

    def _take(self, t: int, k: int) -> np.ndarray:
        out = []
        for _ in range(k):
            out.append(self._peek(t))
            self.positions[t] += 1
        return np.asarray(out, dtype=np.int64)

    def epoch_done(self) -> bool:
        """True when the current epoch's micro-batches are all drawn."""
        return self.step >= self.micro_batches_per_epoch

    def start_next_epoch(self) -> None:
        """Move to the first micro-batch of the next epoch (the tasks' permutations go on where they were)."""
        self.epoch = next_epoch(self.epoch, self.num_epochs)
        self.step = 0

    def next_micro_batch(self) -> MixedSelection:
        """Draw the next micro-batch. Raises ``StopIteration`` at the end of the epoch (call
        :meth:`start_next_epoch`)."""
        if self.epoch_done():
            raise StopIteration(f"epoch {self.epoch} is done")
        p = self.probabilities()
        if self.max_tokens is None:
            counts = share_counts(self.batch_size, p, float(self._rng.random()))
            indices = [self._take(t, int(c)) for t, c in enumerate(counts)]
        else:
            indices = self._fill_budget(p)
        selection = MixedSelection(indices=indices, epoch=self.epoch, step=self.step)
        self.step += 1
        return selection

    def _fill_budget(self, p: np.ndarray) -> list[np.ndarray]:
        credit = self._rng.random(self.num_tasks)
        taken: list[list[int]] = [[] for _ in range(self.num_tasks)]
        used = examples = 0
        while self.batch_size is None or examples < self.batch_size:
            credit += p
            t = int(np.argmax(credit))
            i = self._peek(t)
            n = int(self.lengths[t][i])
            if used + n > self.max_tokens:
                break
            taken[t].append(i)
            self.positions[t] += 1
            credit[t] -= 1.0
            used += n
            examples += 1
        return [np.asarray(x, dtype=np.int64) for x in taken]

    # ------------------------------------------------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "sizes": list(self.sizes),
            "tokens": [int(x.sum()) for x in self.lengths],
            "num_epochs": self.num_epochs,
            "batch_size": self.batch_size,
            "max_tokens": self.max_tokens,
            "micro_batches_per_epoch": self.micro_batches_per_epoch,
            "seed": self.seed,
            "task_seeds": list(self.task_seeds),
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state: the settings (checked on load), ``epoch``, ``step``, every task's ``passes`` and
        ``positions``, and ``rng`` (the numpy generator's bit-generator state)."""
        return {
            **self._settings(),
            "epoch": self.epoch,
            "step": self.step,
            "passes": list(self.passes),
            "positions": list(self.positions),
            "rng": self._rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where ``state`` was taken; every setting must match this sampler's."""
        check_resume_settings(state, self._settings(), "the mixed batch sampler")
        epoch, step = int(state["epoch"]), int(state["step"])
        if not 1 <= epoch <= self.num_epochs or not 0 <= step <= self.micro_batches_per_epoch:
            raise ValueError(f"saved epoch {epoch} / step {step} is outside this schedule")
        passes, positions = [int(x) for x in state["passes"]], [int(x) for x in state["positions"]]
        if (
            len(passes) != self.num_tasks
            or len(positions) != self.num_tasks
            or any(p < 0 for p in passes)
            or any(not 0 <= p <= n for p, n in zip(positions, self.sizes))
        ):
            raise ValueError("saved per-task positions do not fit these tasks")
        self.epoch, self.step, self.passes, self.positions = epoch, step, passes, positions
        self._rng.bit_generator.state = state["rng"]
        self._perms.clear()


# ----------------------------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------------------------
def pack_batches(batches: Sequence[dict], task_ids: Sequence[int], num_tasks: int) -> dict:
    """Pack padded per-task batches (:meth:`fastpals.data.TaskBatcher.collate` dicts) into one packed mixed
    micro-batch (the dict of the module docstring), rows grouped by task in increasing task order.

    ``task_ids[i]``: the model's index of ``batches[i]``'s task (distinct, in ``[0, num_tasks)``). Batches with
    ``input_ids_b`` (``pair_encoding="separate"`` or ``"both"``) are siamese: their ``input_ids`` is sentence 1
    and ``input_ids_b`` sentence 2; ``joint_*`` keys are not used.
    """
    if len(batches) == 0:
        raise ValueError("batches is empty")
    if len(task_ids) != len(batches):
        raise ValueError(f"batches has {len(batches)} entries but task_ids has {len(task_ids)}")
    task_ids = [int(t) for t in task_ids]
    if len(set(task_ids)) != len(task_ids) or not all(0 <= t < num_tasks for t in task_ids):
        raise ValueError(f"task_ids must be distinct ints in [0, {num_tasks}), got {task_ids}")
    labelled = ["labels" in b for b in batches]
    if any(labelled) and not all(labelled):
        raise ValueError("some batches have labels and some do not")
    order = sorted(range(len(batches)), key=lambda i: task_ids[i])
    ids_a, types_a, lengths_a, ids_b, types_b, lengths_b = [], [], [], [], [], []
    rows_task, labels, names, tasks = [], [], [], []
    task_examples = torch.zeros(num_tasks, dtype=torch.int64)
    task_tokens = torch.zeros(num_tasks, dtype=torch.int64)
    for i in order:
        batch, t = batches[i], task_ids[i]
        x, cu, _ = unpad(
            torch.stack([batch["input_ids"], batch["token_type_ids"]], -1), batch["attention_mask"]
        )
        ids_a.append(x[:, 0])
        types_a.append(x[:, 1])
        lens = cu[1:] - cu[:-1]
        lengths_a.append(lens)
        n = lens.shape[0]
        tokens = int(cu[-1])
        if "input_ids_b" in batch:
            xb, cub, _ = unpad(
                torch.stack([batch["input_ids_b"], batch["token_type_ids_b"]], -1), batch["attention_mask_b"]
            )
            ids_b.append(xb[:, 0])
            types_b.append(xb[:, 1])
            lengths_b.append(cub[1:] - cub[:-1])
            tokens += int(cub[-1])
        rows_task.append(torch.full((n,), t, dtype=torch.int64))
        task_examples[t] += n
        task_tokens[t] += tokens
        if all(labelled):
            labels.append(batch["labels"].to(torch.float32))
        names.extend(batch.get("ids", [""] * n))
        tasks.extend([batch.get("task", str(t))] * n)
    lengths = torch.cat(lengths_a)
    out: dict[str, Any] = {
        "input_ids": torch.cat(ids_a),
        "token_type_ids": torch.cat(types_a),
        "cu_seqlens": lengths_to_cu_seqlens(lengths),
        "max_seqlen": int(lengths.max()),
        "task_ids": torch.cat(rows_task),
    }
    if ids_b:
        lb = torch.cat(lengths_b)
        out.update(
            input_ids_b=torch.cat(ids_b),
            token_type_ids_b=torch.cat(types_b),
            cu_seqlens_b=lengths_to_cu_seqlens(lb),
            max_seqlen_b=int(lb.max()),
        )
    if labels:
        out["labels"] = torch.cat(labels)
    out["ids"] = names
    out["tasks"] = tasks
    out["task_examples"] = task_examples
    out["task_tokens"] = task_tokens
    out["num_tokens"] = int(task_tokens.sum())
    return out


def collate_packed(batchers: Sequence[TaskBatcher], selection: MixedSelection) -> dict:
    """The packed micro-batch of ``selection``: ``batchers[t].collate`` of task t's indices (tasks with no
    example skipped), packed by :func:`pack_batches`."""
    if len(batchers) != len(selection.indices):
        raise ValueError(f"{len(batchers)} batchers for a selection over {len(selection.indices)} tasks")
    present = [t for t, idx in enumerate(selection.indices) if len(idx)]
    if not present:
        raise ValueError("the selection holds no example")
    return pack_batches([batchers[t].collate(selection.indices[t]) for t in present], present, len(batchers))


_FORWARD_KEYS = (
    "input_ids", "token_type_ids", "task_ids", "cu_seqlens", "input_ids_b", "token_type_ids_b", "cu_seqlens_b",
)  # fmt: skip


def model_inputs(batch: dict, device: torch.device | str) -> dict[str, Any]:
    """The keyword arguments of ``MultiTaskBert.forward`` from a packed batch, tensors moved to ``device``."""
    out: dict[str, Any] = {k: batch[k].to(device, non_blocking=True) for k in _FORWARD_KEYS if k in batch}
    out["max_seqlen"] = batch["max_seqlen"]
    if "max_seqlen_b" in batch:
        out["max_seqlen_b"] = batch["max_seqlen_b"]
    return out
