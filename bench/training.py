"""Whole training steps of multi-task BERT, one per configuration the benchmarks and the memory report compare.

A step trains on a mixed batch of ``batch`` examples of ``length`` tokens spread round robin over ``T`` tasks
(random token ids, 50-100% of each row real tokens, right padding), with AdamW (lr 2e-5, weight decay 0.01):

- ``bert``: multi-task BERT without PALs: one forward of the batch, the sum of the task losses, one backward;
- ``pal_reference``: BERT + PALs (``PALConfig()``: d_s = 204, 6 heads, in every layer), the PALs run by the
  PyTorch reference (``FASTPALS_KERNELS=reference``); same step as ``bert``;
- ``pal_fused``: the same with the fused Triton PAL (``FASTPALS_KERNELS=triton``; CUDA only);
- ``pal_pcgrad_reference``: BERT + reference PALs + Pytorch-PCGrad's algorithm (``bench/pcgrad_reference.py``):
  one forward, one retained backward per task loss, per-parameter flattening and projections, its merge;
- ``pal_pcgrad_fastpals``: BERT + PALs (fused on CUDA, reference on CPU) + fastpals PCGrad, the trainer's update
  (``fastpals.train.step.run_update``, strategy ``per_task_backward``): per task, a forward and backward of that
  task's rows (the graph freed at once) and ``TaskGradientBuffer.capture``; one read of the losses; then
  ``apply(pcgrad_weights)`` (Gram and combine kernels on CUDA) and the step;
- ``pal_gem_fastpals``: the same with ``gem_weights`` (GEM with the summed update as proposal).

Precisions: ``fp32``; ``bf16`` and ``fp16``: mixed precision as users train (``torch.autocast``, fp32 weights
and optimizer state; fp16 with ``torch.amp.GradScaler``); ``bf16_pure``: weights, gradients and AdamW state in
bf16 (no autocast). Model: ``minilm-l6`` (all-MiniLM-L6-v2, pretrained, 6 layers, d = 384), ``bert-base``
(BERT-base shapes, random weights: speed and memory do not depend on the values) or ``tiny`` (2 layers, d = 64,
PAL d_s 34: the GPU session's CPU rehearsal, ``bench/gpu_session.py --rehearse``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from bench.common import env_var

VARIANTS = (
    "bert",
    "pal_reference",
    "pal_fused",
    "pal_pcgrad_reference",
    "pal_pcgrad_fastpals",
    "pal_gem_fastpals",
)
PRECISIONS = ("fp32", "bf16", "fp16", "bf16_pure")
MODELS = ("minilm-l6", "bert-base", "tiny")

# the comparisons reported side by side: (numerator, denominator) of a time or memory ratio
PAIRS = (
    ("pal_fused", "pal_reference"),
    ("pal_pcgrad_fastpals", "pal_pcgrad_reference"),
    ("pal_gem_fastpals", "pal_pcgrad_reference"),
    ("pal_pcgrad_fastpals", "pal_fused"),
    ("pal_gem_fastpals", "pal_fused"),
    ("pal_pcgrad_fastpals", "pal_reference"),
    ("pal_gem_fastpals", "pal_reference"),
)
BASELINE = "bert"

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16_pure": torch.bfloat16}


@dataclass(frozen=True)
class StepConfig:
    """One benchmarked training step (see the module docstring for the fields' values)."""

    variant: str
    num_tasks: int
    batch: int
    length: int
    precision: str = "fp32"
    model: str = "minilm-l6"
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if not 2 <= self.num_tasks <= 16:
            raise ValueError(f"num_tasks must be in [2, 16], got {self.num_tasks}")
        if self.batch < self.num_tasks:
            raise ValueError(
                f"batch ({self.batch}) must hold at least one example per task ({self.num_tasks})"
            )
        if not 2 <= self.length <= 512:
            raise ValueError(f"length must be in [2, 512], got {self.length}")
        if self.variant == "pal_fused" and torch.device(self.device).type != "cuda":
            raise ValueError("variant pal_fused runs the Triton PAL on CUDA only")
        if self.precision != "fp32" and torch.device(self.device).type != "cuda":
            raise ValueError(f"precision {self.precision} is benchmarked on CUDA only")

    @property
    def has_pal(self) -> bool:
        return self.variant != "bert"

    @property
    def kernels_mode(self) -> str:
        """The ``FASTPALS_KERNELS`` value the step runs under."""
        if self.variant in ("pal_reference", "pal_pcgrad_reference", "bert"):
            return "reference"
        if self.variant == "pal_fused":
            return "triton"
        return "auto"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def task_specs(num_tasks: int) -> list:
    """``num_tasks`` task heads: sst (5-way), para (binary pair), sts (regression pair), then synthetic tasks
    cycling 3-way classification, binary and regression (all single forward, joint pairs)."""
    from fastpals.model.multitask import TaskSpec, get_task

    specs = [get_task(n) for n in ("sst", "para", "sts")][:num_tasks]
    kinds = (("classification", 3), ("binary", 1), ("regression", 1))
    for i in range(len(specs), num_tasks):
        kind, labels = kinds[(i - 3) % 3]
        specs.append(TaskSpec(f"task{i}", kind, num_labels=labels))
    return specs


def build_model(cfg: StepConfig) -> torch.nn.Module:
    from fastpals import BertConfig, MultiTaskBert, MultiTaskConfig, PALConfig

    torch.manual_seed(cfg.seed)
    pal = PALConfig(num_tasks=cfg.num_tasks) if cfg.has_pal else None
    tasks = task_specs(cfg.num_tasks)
    if cfg.model == "minilm-l6":
        model = MultiTaskBert.from_pretrained("minilm-l6", tasks=tasks, pal=pal)
    elif cfg.model == "tiny":
        pal = PALConfig(num_tasks=cfg.num_tasks, hidden=34, num_heads=1) if cfg.has_pal else None
        tiny = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
        model = MultiTaskBert(MultiTaskConfig(tiny, tasks, pal))
    else:
        model = MultiTaskBert(MultiTaskConfig(BertConfig(), tasks, pal))
    model.to(cfg.device)
    if cfg.precision == "bf16_pure":
        model.to(torch.bfloat16)
    return model.train()


def make_batch(cfg: StepConfig, specs: list, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A mixed-task batch: ``input_ids``, ``attention_mask``, ``token_type_ids`` ``[B, L]``, ``task_ids [B]``,
    ``labels [B]`` float (a valid label of each row's task)."""
    b, n = cfg.batch, cfg.length
    ids = torch.randint(1000, 30000, (b, n), generator=generator)
    lengths = torch.randint(max(2, n // 2), n + 1, (b,), generator=generator)
    mask = (torch.arange(n)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    ids[:, 0] = 101  # [CLS]
    task_ids = torch.arange(b) % cfg.num_tasks
    labels = torch.empty(b)
    for t, spec in enumerate(specs):
        rows = task_ids == t
        count = int(rows.sum())
        if spec.kind == "classification":
            labels[rows] = torch.randint(0, spec.num_labels, (count,), generator=generator).float()
        elif spec.kind == "binary":
            labels[rows] = torch.randint(0, 2, (count,), generator=generator).float()
        else:
            labels[rows] = torch.rand(count, generator=generator) * spec.label_scale
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "token_type_ids": torch.zeros_like(ids),
        "task_ids": task_ids,
        "labels": labels,
    }
    return {k: v.to(cfg.device) for k, v in batch.items()}


def split_by_task(batch: dict[str, torch.Tensor], num_tasks: int) -> list[dict[str, torch.Tensor]]:
    """The rows of each task, as ``num_tasks`` batches (what a per-task data loader hands the buffer path)."""
    out = []
    for t in range(num_tasks):
        idx = (batch["task_ids"] == t).nonzero(as_tuple=True)[0]
        out.append({k: v.index_select(0, idx) for k, v in batch.items()})
    return out


def _reference_pcgrad_class() -> type:
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    from pcgrad_reference import ReferencePCGrad

    return ReferencePCGrad


class TrainingStep:
    """Model, optimizer, batch and the step function of one :class:`StepConfig`; calling it runs one step."""

    def __init__(self, cfg: StepConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.specs = task_specs(cfg.num_tasks)
        self.model = build_model(cfg)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-5, weight_decay=0.01)
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.precision == "fp16" else None
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.batch = make_batch(cfg, self.specs, self.generator)
        self.task_batches = split_by_task(self.batch, cfg.num_tasks)
        self.buffer = None
        self.engine = None
        self.reference = None
        self.skipped_steps = 0
        if cfg.variant in ("pal_pcgrad_fastpals", "pal_gem_fastpals"):
            from fastpals.surgery import TaskGradientBuffer, shared_parameters_by_name
            from fastpals.train.step import TorchEngine

            shared, specific = shared_parameters_by_name(self.model)
            self.buffer = TaskGradientBuffer(shared, cfg.num_tasks, task_params=specific)
            autocast = _DTYPES[cfg.precision] if cfg.precision in ("bf16", "fp16") else None
            self.engine = TorchEngine(self.model, self.optimizer, self.scaler, autocast)
        elif cfg.variant == "pal_pcgrad_reference":
            self.reference = _reference_pcgrad_class()(self.optimizer, seed=cfg.seed)

    # ------------------------------------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.precision in ("bf16", "fp16"):
            return torch.autocast(self.device.type, dtype=_DTYPES[self.cfg.precision])
        return contextlib.nullcontext()

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def _losses(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with self._autocast():
            out = self.model(
                batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], batch["task_ids"]
            )
            return self.model.loss(out, batch["labels"])

    def _optimizer_step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def _summed_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        total, _ = self._losses(self.batch)
        self._scaled(total).backward()
        self._optimizer_step()

    def _reference_pcgrad_step(self) -> None:
        _, per_task = self._losses(self.batch)
        self.reference.pc_backward([self._scaled(per_task[s.name]) for s in self.specs])
        self._optimizer_step()

    def _buffer_step(self) -> None:
        from fastpals.surgery import gem_weights, pcgrad_weights
        from fastpals.train.step import MicroBatch, Surgery, run_update

        self.optimizer.zero_grad(set_to_none=True)
        aggregator = pcgrad_weights if self.cfg.variant == "pal_pcgrad_fastpals" else gem_weights
        keys = ("input_ids", "attention_mask", "token_type_ids", "task_ids")
        micro = [
            MicroBatch({k: b[k] for k in keys}, b["labels"], (t,), (b["input_ids"].shape[0],))
            for t, b in enumerate(self.task_batches)
        ]  # the trainer's surgery update, one batch per task
        update = run_update(
            self.engine, micro, "per_task_backward", surgery=Surgery(self.buffer, aggregator, self.generator)
        )
        if not update.stepped:  # non-finite task gradient: no step; with fp16, lower the loss scale ourselves
            self.skipped_steps += 1
            if self.scaler is not None:
                self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())

    def __call__(self) -> None:
        with env_var("FASTPALS_KERNELS", self.cfg.kernels_mode):
            if self.cfg.variant in ("bert", "pal_reference", "pal_fused"):
                self._summed_step()
            elif self.cfg.variant == "pal_pcgrad_reference":
                self._reference_pcgrad_step()
            else:
                self._buffer_step()

    def pal_path(self) -> str | None:
        """Which PAL implementation the step runs: ``triton``, ``reference``, or None (no PALs)."""
        if not self.cfg.has_pal:
            return None
        from fastpals_kernels import use_triton

        with env_var("FASTPALS_KERNELS", self.cfg.kernels_mode):
            probe = torch.empty(0, device=self.device)
            return "triton" if use_triton(probe) else "reference"

    def set_batch(self, batch_size: int) -> None:
        """Replace the batch by one of ``batch_size`` rows (same length, tasks and seed stream)."""
        self.cfg = dataclasses.replace(self.cfg, batch=batch_size)
        self.batch = make_batch(self.cfg, self.specs, self.generator)
        self.task_batches = split_by_task(self.batch, self.cfg.num_tasks)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


# ----------------------------------------------------------------------------------------------------------------
# side-by-side ratios of records measured in one pytest run
# ----------------------------------------------------------------------------------------------------------------

RATIO_METHOD = (
    "time: median step time per configuration over rounds in which all configurations of a group run round robin "
    "(order rotated each round) in one process, when the group was interleaved, else the configuration's own "
    "median; memory: peak of each configuration's own test (torch.cuda.max_memory_allocated above what was "
    "allocated before the model was built, on CUDA; growth of the process's peak resident set over its resident "
    "set before the model was built, on CPU); ratios of these, all from the same pytest session"
)

GROUP_KEYS = ("model", "device_type", "precision", "num_tasks", "batch", "length")


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def group_title(key: dict[str, Any]) -> str:
    return (
        f"{key['model']} on {key['device_type']}, {key['precision']}, T={key['num_tasks']}, "
        f"batch {key['batch']} x {key['length']} tokens"
    )


def side_by_side(
    records: list[dict[str, Any]], interleaved: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Group step records by :data:`GROUP_KEYS`; per group, every variant's time and peak against ``bert`` and
    the ratios of :data:`PAIRS` present. A group's time is its ``interleaved`` median (entries with the same
    :data:`GROUP_KEYS` and ``medians_s``) when given, else the record's own ``median_s``.
    Returns ``{"groups": [{"key", "title", "timing", "variants", "pairs"}]}``."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(tuple(r[k] for k in GROUP_KEYS), []).append(r)
    paired = {tuple(e[k] for k in GROUP_KEYS): e for e in interleaved or []}
    out = []
    for key_values, recs in groups.items():
        inter = paired.get(key_values)
        by_variant = {}
        for r in recs:
            r = dict(r)
            if inter is not None and r["variant"] in inter["medians_s"]:
                r["median_s"] = inter["medians_s"][r["variant"]]
            by_variant[r["variant"]] = r
        base = by_variant.get(BASELINE)
        variants = []
        for name in VARIANTS:
            r = by_variant.get(name)
            if r is None:
                continue
            variants.append(
                {
                    "variant": name,
                    "median_s": r["median_s"],
                    "peak_bytes": r["peak_bytes"],
                    "time_vs_bert": _ratio(r["median_s"], base["median_s"]) if base else None,
                    "memory_vs_bert": _ratio(r["peak_bytes"], base["peak_bytes"]) if base else None,
                }
            )
        pairs = []
        for num, den in PAIRS:
            if num in by_variant and den in by_variant:
                a, b = by_variant[num], by_variant[den]
                pairs.append(
                    {
                        "numerator": num,
                        "denominator": den,
                        "time_ratio": _ratio(a["median_s"], b["median_s"]),
                        "memory_ratio": _ratio(a["peak_bytes"], b["peak_bytes"]),
                    }
                )
        key = dict(zip(GROUP_KEYS, key_values))
        timing = f"interleaved, {inter['rounds']} rounds" if inter is not None else "each configuration alone"
        out.append(
            {"key": key, "title": group_title(key), "timing": timing, "variants": variants, "pairs": pairs}
        )
    return {"groups": out}
