"""Multi-task fine-tuning of (PAL-)BERT with DeepSpeed: options, checks, the training loop, evaluation, results.

Launch with ``deepspeed train.py --ds_config configs/<name>.json [options]`` or plain ``python train.py ...``
(one process: the rank/world/master environment variables get defaults and DeepSpeed initialises a one-rank
gloo group on CPU; DeepSpeed stays the engine either way). ``python train.py --help`` explains every option.

The loop
--------
A :class:`~fastpals.sampling.TaskSampler` decides the task of every micro-batch; each micro-batch holds
``--batch-size`` examples of one task and gets its own forward and ``engine.backward``. Without surgery the
DeepSpeed engine accumulates ``--grad-accum`` micro-batches per update (``gradient_accumulation_steps`` in the
config; DeepSpeed averages them and clips with ``gradient_clipping`` inside ``engine.step()``). With surgery
(``--surgery pcgrad|gem``) an update is the sampler's group (``random_round_robin``: one batch of every task;
``every_task_plus_annealed``: one of every task plus ``--extra-batches`` annealed ones; other methods: as many
draws as tasks), DeepSpeed's accumulation is 1, and after each task batch's backward its gradient of the shared
(encoder) parameters is captured into a :class:`fastpals.surgery.TaskGradientBuffer`; the aggregator's
combined gradient ``sum_t w_t g_t`` is written back before ``engine.step()``, which clips it (clipping after
surgery). Task-specific parameters (PALs, heads) keep their own task's gradient.

Gradients under DeepSpeed 0.19.8: the buffer reads gradients with ``deepspeed.utils.safe_get_full_grad`` and
writes them with ``safe_set_full_grad`` (a zero tensor where the buffer clears one). Checked on CPU, one rank:
ZeRO-0 fp32 (``safe_*`` fall through to ``p.grad``) and ZeRO-1 bf16, where they are the fp32 gradients of the
optimizer's partitions (the bf16 module's ``p.grad`` is not where the reduced gradient lives), so the buffer and
its combined gradient are fp32 (tests: ``test_pcgrad_update_under_deepspeed``, ``test_surgery_runs``). ZeRO-2
uses the same calls (not run here: no GPU). ZeRO-3 is refused. On CPU fp16 is refused (it needs CUDA), and bf16
with ZeRO-0 falls back to DeepSpeed's ``FP16_UnfusedOptimizer`` (no fp32 master weights) and is refused too, so
``configs/cpu_bf16.json`` uses ZeRO-1. ``configs/cpu_fp32.json`` (ZeRO-0, fp32) is about 3x faster per step on
CPUs without bf16 matrix instructions.

Non-finite losses: the loss of every micro-batch is checked; a NaN/inf loss stops training before its backward
with :class:`NonFiniteLossError` naming the update step, the task and the value, after a ``"nonfinite"`` record
in ``metrics.jsonl``; the last checkpoint is untouched (lower the learning rate, or use bf16 instead of fp16, and
``--resume``). A step that surgery skips for non-finite task gradients stops training the same way.

Outputs in ``--out``: ``metrics.jsonl`` (a record per update, per evaluation, per epoch), ``tensorboard/``,
``checkpoints/`` (DeepSpeed checkpoint + sampler, batcher and RNG states; each epoch, on SIGTERM/SIGINT),
``best/`` (the model with the best dev overall score, :meth:`MultiTaskBert.load` reads it), ``predictions/``
(CS224N-format dev and test predictions of the best model), ``results.json``, ``training_curves.png``,
``confusion_sst.png``, ``confusion_sts.png``.

Evaluation: accuracy for SST and CFIMDB, accuracy for Quora on the held-out 10% hash split of ``quora-dev.csv``
(see :mod:`fastpals.data`; there is no other labelled Quora file), Pearson r for STS over the whole dev set;
overall = ``(sst + para + (r + 1) / 2) / 3`` (with other task sets: the mean of accuracies and ``(r + 1) / 2``).
On CPU a bf16 model is evaluated through an fp32 copy of its (bf16-rounded) weights: CPUs without bf16 matrix
units run fp32 several times faster.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastpals.data import DATA_DIR_ENV, TASK_FORMATS, DataWarning, TaskBatcher, load_task, resolve_data_dir
from fastpals.model import PALConfig, freeze_shared_parameters, task_specific_kind
from fastpals.multitask import TASKS, MultiTaskBert, get_task
from fastpals.sampling import GROUPED_METHODS, SAMPLING_METHODS, TaskSampler

__all__ = [
    "PAL_PRESETS",
    "ConfigError",
    "NonFiniteLossError",
    "Trainer",
    "TrainingInterrupted",
    "build_parser",
    "build_pal_config",
    "check_ds_config",
    "load_ds_config",
    "lr_lambda",
    "main",
    "optimizer_param_groups",
    "validate_args",
]

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "cpu_bf16.json"
PAL_PRESETS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "default": {},
    "12heads": {"num_heads": 12},
    "per_layer": {"shared_projections": False},
    "half": {"layers": 6, "hidden": 276, "num_heads": 6},
    "top": {"variant": "top"},
    "top_parallel": {"variant": "top_parallel"},
    "gate": {"gate": True},
    "embert": {"variant": "embert"},
}
SURGERIES = ("none", "pcgrad", "gem")
OPTIMIZERS = ("adamw", "sgd", "rmsprop")
# options that must not change when a run is resumed (the others, e.g. --out or --eval-every, may)
_RESUME_KEYS = (
    "model", "tasks", "epochs", "steps_per_epoch", "batch_size", "lr", "pal_lr", "head_lr", "warmup",
    "optimizer", "weight_decay", "max_length", "seed", "sampling", "surgery", "pal", "pal_heads", "pal_hidden",
    "head", "pair_mode", "grad_accum", "extra_batches", "freeze_bert", "max_train",
)  # fmt: skip


class ConfigError(ValueError):
    """An option or the DeepSpeed config is wrong; the message says what to change. Raised before training."""


class NonFiniteLossError(RuntimeError):
    """A loss (or a task gradient under surgery) was NaN/inf: ``step`` (update, from 1), ``task``, ``value``."""

    def __init__(self, step: int, task: str, value: float, what: str = "loss") -> None:
        self.step, self.task, self.value = step, task, value
        super().__init__(
            f"non-finite {what} {value} at update step {step}, task {task!r}: training stopped before this "
            f"step's update (the last checkpoint is intact). Lower --lr / --pal-lr / --head-lr, use bf16 instead "
            f"of fp16, then --resume."
        )


class TrainingInterrupted(RuntimeError):
    """SIGTERM/SIGINT arrived: a checkpoint was written; ``--resume`` continues. ``signum`` says which."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(
            f"stopped by signal {signal.Signals(signum).name} after update step {step}; checkpoint {checkpoint} "
            f"(continue with the same options and --resume)"
        )


# ----------------------------------------------------------------------------------------------------------------
# options
# ----------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``train.py`` / ``fastpals train`` command line."""
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Multi-task fine-tuning of BERT + PALs (SST, Quora, STS) with DeepSpeed. "
        "Run as `deepspeed train.py --ds_config configs/<name>.json [options]` or `python train.py [options]`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a = p.add_argument
    a(
        "--ds_config",
        "--ds-config",
        dest="ds_config",
        default=str(DEFAULT_CONFIG),
        help="DeepSpeed JSON config (precision, ZeRO stage, gradient clipping). configs/cpu_bf16.json for CPU; "
        "configs/gpu_{bf16,fp16}_zero{0,1,2}.json for GPUs. Its batch and accumulation entries must agree with "
        "--batch-size and --grad-accum (missing ones are filled in); optimizer and scheduler come from the options",
    )
    a(
        "--model",
        default="minilm-l6",
        help="encoder checkpoint: 'minilm-l6' (offline all-MiniLM-L6-v2), a folder with config.json + "
        "model.safetensors/pytorch_model.bin + vocab.txt, or a Hugging Face hub name",
    )
    a("--tasks", default="sst,para,sts", help=f"comma-separated tasks among {', '.join(TASKS)}")
    a("--data-dir", default=None, help=f"folder of the task CSV files (default: ${DATA_DIR_ENV})")
    a("--epochs", type=int, default=3, help="training epochs")
    a(
        "--steps-per-epoch",
        type=int,
        default=None,
        help="optimizer updates per epoch (default: 2400 as in Bert-n-Pals; with round_robin: one full pass over "
        "every task's batches, which a number cuts short)",
    )
    a(
        "--batch-size",
        type=int,
        default=None,
        help="examples per micro-batch, all of one task (default: the config's train_micro_batch_size_per_gpu, "
        "else 32)",
    )
    a("--lr", type=float, default=2e-5, help="peak learning rate of the BERT encoder weights")
    a("--pal-lr", type=float, default=None, help="peak learning rate of the PAL parameters (default: --lr)")
    a("--head-lr", type=float, default=None, help="peak learning rate of the task heads (default: --lr)")
    a(
        "--warmup",
        type=float,
        default=0.1,
        help="fraction of all updates with a linear warm-up from 0; then linear decay to 0",
    )
    a(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="adamw (betas 0.9/0.999, eps 1e-6), sgd (momentum 0.9) or rmsprop",
    )
    a(
        "--weight-decay",
        type=float,
        default=0.01,
        help="decoupled weight decay; never on biases and LayerNorms",
    )
    a("--max-length", type=int, default=128, help="tokens per sequence (a pair counts together), <= 512")
    a("--seed", type=int, default=0, help="seed of weights init, sampling, batch order and dropout")
    a("--out", default="runs/default", help="output folder (metrics, checkpoints, best model, results)")
    a("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    a(
        "--sampling",
        choices=SAMPLING_METHODS,
        default="annealed",
        help="which task each micro-batch comes from (see fastpals.sampling)",
    )
    a(
        "--surgery",
        choices=SURGERIES,
        default="none",
        help="gradient surgery on the per-task gradients of the shared weights in each update",
    )
    a(
        "--pal",
        choices=list(PAL_PRESETS),
        default="default",
        help="PAL variant: none (multi-task baseline), default (Bert-n-Pals: d_s 204, 6 heads, shared V^E/V^D), "
        "12heads, per_layer (V^E/V^D per layer), half (top 6 layers, d_s 276), top, top_parallel, gate, embert",
    )
    a("--pal-heads", type=int, default=None, help="attention heads inside each PAL (overrides the preset)")
    a("--pal-hidden", type=int, default=None, help="PAL width d_s (overrides the preset)")
    a("--head", choices=("linear", "mlp"), default="linear", help="task head on the pooled features")
    a(
        "--pair-mode",
        choices=("joint", "sbert_cosine", "sbert_concat"),
        default="joint",
        help="pair tasks: joint cross-encoder, or siamese (SBERT) with cosine similarity (STS; Quora then uses "
        "sbert_concat) or with (u, v, |u-v|) into the head",
    )
    a(
        "--grad-accum",
        type=int,
        default=None,
        help="micro-batches per update without surgery (default: the config's gradient_accumulation_steps, else 1)",
    )
    a("--extra-batches", type=int, default=1, help="annealed batches per update of every_task_plus_annealed")
    a(
        "--eval-every",
        type=int,
        default=0,
        help="also evaluate on dev every N updates (0: at epoch ends only)",
    )
    a("--eval-at-start", action="store_true", help="evaluate the untrained model (step 0) first")
    a(
        "--max-eval",
        type=int,
        default=None,
        help="use at most N dev examples per task (a fixed random subset, the same in every run) for quick runs",
    )
    a("--max-train", type=int, default=None, help="use at most N training examples per task (quick runs)")
    a("--max-predict", type=int, default=None, help="predict at most N test examples per task (quick runs)")
    a("--freeze-bert", action="store_true", help="train only PALs, heads and LayerNorms")
    a("--no-progress", action="store_true", help="no progress bars")
    a(
        "--local_rank",
        "--local-rank",
        dest="local_rank",
        type=int,
        default=None,
        help="set by the deepspeed launcher; do not pass by hand",
    )
    a(
        "--stop-after-steps",
        type=int,
        default=None,
        help="testing: send this process SIGTERM after N updates (checkpoint and stop, as a real kill would)",
    )
    a("--inject-nan-at-step", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _positive(args: argparse.Namespace, name: str, allow_none: bool = False, low: float = 1) -> None:
    value = getattr(args, name)
    if value is None and allow_none:
        return
    if value is None or value < low:
        raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def build_pal_config(args: argparse.Namespace) -> PALConfig | None:
    """The :class:`PALConfig` of ``--pal`` with ``--pal-heads`` / ``--pal-hidden``; None for ``--pal none``."""
    preset = PAL_PRESETS[args.pal]
    if preset is None:
        if args.pal_heads is not None or args.pal_hidden is not None:
            raise ConfigError("--pal-heads/--pal-hidden need PALs: drop them or choose a --pal variant")
        return None
    kw = dict(preset)
    if args.pal_heads is not None:
        kw["num_heads"] = args.pal_heads
    if args.pal_hidden is not None:
        kw["hidden"] = args.pal_hidden
    cfg = PALConfig(num_tasks=len(args.task_list), **kw)
    if cfg.hidden < 1 or cfg.num_heads < 1 or cfg.hidden % cfg.num_heads:
        raise ConfigError(
            f"--pal-heads {cfg.num_heads} does not divide the PAL width d_s = {cfg.hidden} (--pal-hidden): "
            f"choose heads that divide d_s, e.g. {', '.join(str(h) for h in range(1, 13) if cfg.hidden % h == 0)}"
        )
    if cfg.variant in ("top", "top_parallel") and cfg.hidden % cfg.top_heads:
        raise ConfigError(f"--pal {args.pal}: its {cfg.top_heads} top heads do not divide d_s = {cfg.hidden}")
    return cfg


def validate_args(args: argparse.Namespace) -> argparse.Namespace:
    """Check every option (and that the data files exist) before anything heavy happens; fills ``task_list``,
    ``data_path`` and ``pal_config``. Raises :class:`ConfigError` saying what to change."""
    tasks = [t.strip() for t in str(args.tasks).split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ConfigError(f"--tasks: unknown task(s) {unknown or tasks}; choose among {', '.join(TASKS)}")
    if len(set(tasks)) != len(tasks):
        raise ConfigError(f"--tasks lists a task twice: {tasks}")
    args.task_list = tasks
    if args.batch_size is None or args.grad_accum is None:
        ds = load_ds_config(args.ds_config)
        if args.batch_size is None:
            args.batch_size = ds.get("train_micro_batch_size_per_gpu", 32)
        if args.grad_accum is None:
            args.grad_accum = 1 if args.surgery != "none" else ds.get("gradient_accumulation_steps", 1)
    for name in ("epochs", "batch_size", "grad_accum"):
        _positive(args, name)
    for name in ("steps_per_epoch", "max_eval", "max_train", "max_predict", "stop_after_steps"):
        _positive(args, name, allow_none=True)
    _positive(args, "extra_batches", low=0)
    _positive(args, "eval_every", low=0)
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    if not 8 <= args.max_length <= 512:
        raise ConfigError(f"--max-length must be in [8, 512], got {args.max_length}")
    for name in ("lr", "pal_lr", "head_lr"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number, got {value}")
    if not 0.0 <= args.warmup < 1.0:
        raise ConfigError(f"--warmup is a fraction of the updates in [0, 1), got {args.warmup}")
    if args.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be >= 0, got {args.weight_decay}")
    if args.surgery != "none" and args.grad_accum != 1:
        raise ConfigError(
            "--surgery groups the micro-batches of an update by itself (see --sampling); use --grad-accum 1"
        )
    if args.surgery != "none" and len(tasks) < 2:
        raise ConfigError("--surgery needs at least two --tasks")
    if args.sampling in GROUPED_METHODS and args.surgery == "none" and args.grad_accum != 1:
        raise ConfigError(
            f"--sampling {args.sampling} sets the micro-batches of an update; use --grad-accum 1"
        )
    if args.pair_mode == "sbert_cosine" and "sts" not in tasks:
        raise ConfigError("--pair-mode sbert_cosine is for STS (regression); add sts or use sbert_concat")
    args.pal_config = build_pal_config(args)
    if args.freeze_bert and args.pal_config is None:
        raise ConfigError(
            "--freeze-bert with --pal none would train only the heads and LayerNorms; pick a --pal"
        )
    try:
        data_path = resolve_data_dir(args.data_dir)
    except FileNotFoundError as err:
        raise ConfigError(f"--data-dir: {err}") from None
    missing = [
        str(data_path / TASK_FORMATS[t].files[split])
        for t in tasks
        for split in ("train", "dev")
        if not (data_path / TASK_FORMATS[t].files[split]).is_file()
    ]
    if missing:
        raise ConfigError(f"missing data file(s): {', '.join(missing)} (check --data-dir / ${DATA_DIR_ENV})")
    args.data_path = data_path
    return args


# ----------------------------------------------------------------------------------------------------------------
# DeepSpeed config
# ----------------------------------------------------------------------------------------------------------------
def load_ds_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read a DeepSpeed JSON config; a missing file or bad JSON is a :class:`ConfigError`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--ds_config {path} does not exist (shipped configs are in configs/)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"--ds_config {path}:{err.lineno}: not valid JSON ({err.msg})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--ds_config {path}: the top level must be a JSON object")
    return cfg


def _enabled(cfg: dict[str, Any], key: str) -> bool:
    section = cfg.get(key)
    return isinstance(section, dict) and bool(section.get("enabled", False))


def check_ds_config(
    cfg: dict[str, Any],
    batch_size: int,
    grad_accum: int,
    surgery: str = "none",
    world_size: int = 1,
    cuda: bool | None = None,
    name: str = "--ds_config",
) -> dict[str, Any]:
    """Check a DeepSpeed config against the options and return a completed copy.

    Fills ``train_micro_batch_size_per_gpu`` (= ``batch_size``), ``gradient_accumulation_steps``
    (= ``grad_accum``, 1 with surgery) and ``train_batch_size`` when absent; every contradiction raises
    :class:`ConfigError` naming the entry and what to change. ``cuda`` defaults to ``torch.cuda.is_available()``.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    out = copy.deepcopy(cfg)
    accum = 1 if surgery != "none" else grad_accum
    micro = out.setdefault("train_micro_batch_size_per_gpu", batch_size)
    if micro != batch_size:
        raise ConfigError(
            f"{name}: train_micro_batch_size_per_gpu = {micro} but --batch-size {batch_size}: make them equal "
            f"(or delete the entry from the config)"
        )
    gas = out.setdefault("gradient_accumulation_steps", accum)
    if gas != accum:
        why = " (surgery accumulates the task batches of an update itself)" if surgery != "none" else ""
        raise ConfigError(
            f"{name}: gradient_accumulation_steps = {gas} but the run needs {accum} (--grad-accum {grad_accum}, "
            f"--surgery {surgery}){why}: set it to {accum} or delete it"
        )
    total = out.setdefault("train_batch_size", batch_size * accum * world_size)
    if total != batch_size * accum * world_size:
        raise ConfigError(
            f"{name}: train_batch_size = {total} but batch size {batch_size} x accumulation {accum} x "
            f"{world_size} rank(s) = {batch_size * accum * world_size}: fix it or delete it"
        )
    for key in ("optimizer", "scheduler"):
        if key in out:
            raise ConfigError(
                f"{name}: remove the {key!r} section; the optimizer and the warm-up/decay schedule come from "
                f"--optimizer, --lr, --pal-lr, --head-lr, --warmup, --weight-decay"
            )
    fp16, bf16 = _enabled(out, "fp16"), _enabled(out, "bf16")
    if fp16 and bf16:
        raise ConfigError(f"{name}: fp16 and bf16 are both enabled; enable one of them")
    if fp16 and not cuda:
        raise ConfigError(
            f"{name}: fp16 needs a CUDA GPU and none is available: use configs/cpu_bf16.json (bf16) on CPU"
        )
    stage = (out.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2):
        raise ConfigError(
            f"{name}: zero_optimization.stage = {stage}: fastpals trains with ZeRO 0, 1 or 2 (ZeRO-3 partitions "
            f"the stacked per-task PAL weights and is not supported)"
        )
    if bf16 and stage == 0 and not cuda:
        raise ConfigError(
            f"{name}: bf16 with ZeRO stage 0 on CPU runs DeepSpeed's FP16_UnfusedOptimizer without fp32 master "
            f"weights; use zero_optimization.stage 1 (configs/cpu_bf16.json)"
        )
    clip = out.get("gradient_clipping", 0.0)
    if not isinstance(clip, (int, float)) or clip < 0:
        raise ConfigError(f"{name}: gradient_clipping must be a number >= 0, got {clip!r}")
    return out


# ----------------------------------------------------------------------------------------------------------------
# optimizer and schedule
# ----------------------------------------------------------------------------------------------------------------
def _no_decay(name: str) -> bool:
    leaf = name.split(".")[-1]
    return (
        leaf.endswith("bias")
        or "LayerNorm" in name
        or "layer_norm" in name
        or leaf.startswith("ln_")
        or leaf == "gate"
    )


def optimizer_param_groups(
    model: torch.nn.Module, lr: float, pal_lr: float, head_lr: float, weight_decay: float
) -> list[dict[str, Any]]:
    """Parameter groups: {encoder, pal, head} x {decay, no decay}; no weight decay on biases, LayerNorm
    weights and PAL gates. Frozen parameters are left out; empty groups are dropped. Each group has a ``name``."""
    groups: dict[tuple[str, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        kind = task_specific_kind(name) or "encoder"
        groups.setdefault((kind, not _no_decay(name)), []).append(p)
    rates = {"encoder": lr, "pal": pal_lr, "head": head_lr}
    out = []
    for kind in ("encoder", "pal", "head"):
        for decay in (True, False):
            params = groups.get((kind, decay))
            if params:
                out.append(
                    {
                        "params": params,
                        "lr": rates[kind],
                        "weight_decay": weight_decay if decay else 0.0,
                        "name": f"{kind}{'' if decay else '_no_decay'}",
                    }
                )
    return out


def make_optimizer(groups: list[dict[str, Any]], name: str) -> torch.optim.Optimizer:
    """``adamw`` (betas 0.9/0.999, eps 1e-6), ``sgd`` (momentum 0.9) or ``rmsprop`` over ``groups``."""
    if name == "adamw":
        return torch.optim.AdamW(groups, betas=(0.9, 0.999), eps=1e-6)
    if name == "sgd":
        return torch.optim.SGD(groups, momentum=0.9)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, alpha=0.99, eps=1e-8)
    raise ConfigError(f"--optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")


def lr_lambda(step: int, total: int, warmup: float) -> float:
    """Multiplier of the peak learning rate for update ``step`` (from 0) of ``total``: linear warm-up over
    ``round(warmup * total)`` updates (``(step + 1) / w``), then linear decay reaching 0 after ``total``."""
    w = int(round(warmup * total))
    if step < w:
        return (step + 1) / w
    return max(0.0, (total - step) / max(1, total - w))


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_single_process_env() -> None:
    """Defaults for ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (a free port) so
    that ``deepspeed.initialize`` works without the launcher; values set by a launcher are kept."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())


def _load_split(
    task: str, split: str, data_dir: Path, limit: int | None, log: Any, sample: bool = False
) -> list:
    """The examples of one split; with ``limit``: the first ``limit`` (``sample=False``) or a fixed random subset
    of ``limit`` kept in file order (``sample=True``: numpy seed 0, independent of ``--seed``, so that capped dev
    sets are representative and the same for every run; the dev files are not shuffled, e.g. SST's first rows
    are mostly positive)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DataWarning)
        examples = load_task(task, split, data_dir, strict=False)
    for w in caught:
        if issubclass(w.category, DataWarning):
            log(f"[data] {task}/{split}: {w.message}")
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if not limit or limit >= len(examples):
        return examples
    if sample:
        keep = np.sort(np.random.default_rng(0).choice(len(examples), size=limit, replace=False))
        return [examples[i] for i in keep]
    return examples[:limit]


def _rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def overall_from(dev: dict[str, float]) -> float:
    """CS224N overall ``(sst + para + (r + 1)/2) / 3`` when the three are there; else the mean of accuracies and
    ``(r + 1)/2``. A NaN Pearson (constant predictions) counts as r = 0."""
    parts = []
    for task, value in dev.items():
        if task == "overall":
            continue
        if TASKS[task].metric == "pearson":
            value = 0.0 if math.isnan(value) else value
            parts.append((value + 1.0) / 2.0)
        else:
            parts.append(value)
    return float(sum(parts) / len(parts))


# ----------------------------------------------------------------------------------------------------------------
# the trainer
# ----------------------------------------------------------------------------------------------------------------
class Trainer:
    """One training run. ``Trainer(args).run()`` → the results dict (also written to ``<out>/results.json``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = validate_args(args)
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.is_main = self.rank == 0
        self.out = Path(args.out)
        self.ds_config = check_ds_config(
            load_ds_config(args.ds_config), args.batch_size, args.grad_accum, args.surgery, self.world_size
        )
        self.ckpt_dir = self.out / "checkpoints"
        if args.resume and not (self.ckpt_dir / "latest").is_file():
            raise ConfigError(f"--resume: no checkpoint in {self.ckpt_dir} (nothing to resume)")
        if not args.resume and (self.ckpt_dir / "latest").is_file():
            raise ConfigError(
                f"--out {self.out} already holds a run with checkpoints: pass --resume to continue it, or choose "
                f"another --out"
            )
        self._stop_signal: int | None = None
        self.timings: dict[str, float] = {}
        self.step_losses: dict[str, tuple[list[int], list[float]]] = {t: ([], []) for t in args.task_list}
        self.evals: list[dict[str, Any]] = []
        self.best: dict[str, Any] = {"overall": -math.inf, "step": None, "epoch": None, "dev": None}
        self.global_step = 0
        self.evaluated_epoch = 0
        self.untrained: dict[str, float] | None = None

    # --- logging ------------------------------------------------------------------------------------------------
    def log(self, message: str) -> None:
        if self.is_main:
            if getattr(self, "_bar", None) is not None:
                from tqdm import tqdm

                tqdm.write(message, file=sys.stderr)
            else:
                print(message, file=sys.stderr, flush=True)

    def record(self, entry: dict[str, Any]) -> None:
        """Append one JSON line to ``metrics.jsonl`` (main rank)."""
        if self.is_main:
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(entry) + "\n")

    # --- set-up -------------------------------------------------------------------------------------------------
    def _setup_data(self) -> None:
        args = self.args
        from fastpals.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_pretrained(args.model)
        pair_enc = {}
        for t in args.task_list:
            pair_enc[t] = "joint" if (args.pair_mode == "joint" or not TASK_FORMATS[t].pair) else "separate"
        self.pair_encoding = pair_enc
        self.train_batchers: dict[str, TaskBatcher] = {}
        self.dev_batchers: dict[str, TaskBatcher] = {}
        self.train_sizes: list[int] = []
        for i, t in enumerate(args.task_list):
            train = _load_split(t, "train", args.data_path, args.max_train, self.log)
            self.train_sizes.append(len(train))
            shard = train[self.rank :: self.world_size] if self.world_size > 1 else train
            self.train_batchers[t] = TaskBatcher(
                shard, self.tokenizer, t, args.batch_size, max_length=args.max_length, shuffle=True,
                seed=args.seed * 1000 + i, pair_encoding=pair_enc[t],
            )  # fmt: skip
            dev = _load_split(t, "dev", args.data_path, args.max_eval, self.log, sample=True)
            self.dev_batchers[t] = TaskBatcher(
                dev, self.tokenizer, t, max(args.batch_size, 64), max_length=args.max_length, shuffle=False,
                bucket_by_length=False, pair_encoding=pair_enc[t],
            )  # fmt: skip
        # identical on every rank: batches of the smallest shard
        batches = [math.ceil((n // self.world_size) / args.batch_size) or 1 for n in self.train_sizes]
        steps = args.steps_per_epoch
        if steps is None and args.sampling != "round_robin":
            steps = 2400
        self.sampler = TaskSampler(
            args.sampling, self.train_sizes, batches, args.epochs, steps,
            micro_batches_per_update=args.grad_accum if args.surgery == "none" else len(args.task_list),
            extra=args.extra_batches, seed=args.seed,
        )  # fmt: skip
        self.total_updates = self.sampler.updates_per_epoch * args.epochs
        sizes = ", ".join(f"{t} {n}" for t, n in zip(args.task_list, self.train_sizes))
        self.log(
            f"[data] train examples: {sizes}; {self.sampler.updates_per_epoch} updates/epoch x {args.epochs} "
            f"epochs, sampling {args.sampling}; dev: "
            + ", ".join(f"{t} {len(b.examples)}" for t, b in self.dev_batchers.items())
            + (" (para dev = held-out 10% hash split of quora-dev.csv)" if "para" in args.task_list else "")
        )

    def _setup_model(self) -> None:
        args = self.args
        torch.manual_seed(args.seed)
        np.random.seed(args.seed)
        random.seed(args.seed)
        specs = []
        for t in args.task_list:
            spec = get_task(t)
            mode = args.pair_mode
            if spec.pair and mode != "joint":
                if mode == "sbert_cosine" and spec.kind != "regression":
                    mode = "sbert_concat"
                spec = dataclasses.replace(spec, pair_mode=mode)
            specs.append(dataclasses.replace(spec, head=args.head))
        try:
            model = MultiTaskBert.from_pretrained(args.model, tasks=specs, pal=args.pal_config)
        except (FileNotFoundError, OSError) as err:
            raise ConfigError(f"--model {args.model}: {err}") from None
        if args.pal_config is not None:
            try:
                args.pal_config.validate(model.config.bert.num_hidden_layers)
            except ValueError as err:
                raise ConfigError(f"--pal {args.pal}: {err}") from None
        if args.freeze_bert:
            freeze_shared_parameters(model)  # PALs, heads and LayerNorms (by module type) keep training
        self.model = model

    def _setup_engine(self) -> None:
        import deepspeed

        args = self.args
        set_single_process_env()
        lr = args.lr
        groups = optimizer_param_groups(
            self.model, lr, args.pal_lr or lr, args.head_lr or lr, args.weight_decay
        )
        optimizer = make_optimizer(groups, args.optimizer)
        total, warmup = self.total_updates, args.warmup

        def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, total, warmup))

        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config
        )
        self.device = self.engine.device
        self.zero_stage = self.engine.zero_optimization_stage()
        self.surgery_buffer = None
        if args.surgery != "none":
            from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

            from fastpals.surgery import TaskGradientBuffer, shared_parameters_by_name

            def setter(p: torch.nn.Parameter, g: torch.Tensor | None) -> None:
                safe_set_full_grad(p, g if g is not None else torch.zeros_like(p, dtype=torch.float32))

            shared, specific = shared_parameters_by_name(self.engine.module)
            self.surgery_buffer = TaskGradientBuffer(
                shared, len(args.task_list), torch.float32, task_params=specific,
                grad_getter=safe_get_full_grad, grad_setter=setter, grad_dtype=torch.float32,
                # ZeRO-1/2 backwards replace the reduced gradients instead of adding to them (measured with
                # DeepSpeed 0.19.8), so each task's head/PAL gradients are taken out at capture time too.
                capture_task_params=self.zero_stage >= 1,
            )  # fmt: skip
            self.surgery_generator = torch.Generator().manual_seed(args.seed)

    # --- checkpoints --------------------------------------------------------------------------------------------
    def _client_state(self) -> dict[str, Any]:
        return {
            "global_step": self.global_step,
            "evaluated_epoch": self.evaluated_epoch,
            "sampler": self.sampler.state_dict(),
            "batchers": {t: b.state_dict() for t, b in self.train_batchers.items()},
            "rng": _rng_state(),
            "surgery_rng": self.surgery_generator.get_state() if self.surgery_buffer is not None else None,
            "step_losses": self.step_losses,
            "evals": self.evals,
            "best": self.best,
            "untrained": self.untrained,
            "args": {k: getattr(self.args, k) for k in _RESUME_KEYS},
            "timings": self.timings,
        }

    def save_checkpoint(self) -> Path:
        """DeepSpeed checkpoint (module, optimizer, scheduler) + client state; the previous one is removed."""
        tag = f"step{self.global_step}"
        previous = (
            (self.ckpt_dir / "latest").read_text().strip() if (self.ckpt_dir / "latest").is_file() else None
        )
        self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state=self._client_state())
        if self.is_main and previous and previous != tag and (self.ckpt_dir / previous).is_dir():
            shutil.rmtree(self.ckpt_dir / previous)
        return self.ckpt_dir / tag

    def load_checkpoint(self) -> None:
        path, state = self.engine.load_checkpoint(str(self.ckpt_dir))
        if path is None:
            raise ConfigError(f"--resume: DeepSpeed could not load a checkpoint from {self.ckpt_dir}")
        saved = state["args"]
        differ = [k for k in _RESUME_KEYS if saved.get(k) != getattr(self.args, k)]
        if differ:
            detail = ", ".join(
                f"--{k.replace('_', '-')} (saved {saved.get(k)!r}, now {getattr(self.args, k)!r})"
                for k in differ
            )
            raise ConfigError(f"--resume with different options: {detail}; use the options of the saved run")
        self.global_step = state["global_step"]
        self.evaluated_epoch = state["evaluated_epoch"]
        self.sampler.load_state_dict(state["sampler"])
        for t, b in self.train_batchers.items():
            b.load_state_dict(state["batchers"][t])
        if self.surgery_buffer is not None:
            self.surgery_generator.set_state(state["surgery_rng"])
        self.step_losses = state["step_losses"]
        self.evals = state["evals"]
        self.best = state["best"]
        self.untrained = state["untrained"]
        self.timings = dict(state.get("timings") or {})
        _set_rng_state(state["rng"])
        self.log(f"[resume] {path}: update step {self.global_step}, epoch {self.sampler.epoch}")

    # --- evaluation ---------------------------------------------------------------------------------------------
    def _eval_model(self) -> torch.nn.Module:
        module = self.engine.module
        if self.device.type == "cpu" and next(module.parameters()).dtype != torch.float32:
            module = copy.deepcopy(module).float()
        return module

    @torch.no_grad()
    def predict_batches(
        self, model: torch.nn.Module, batcher: TaskBatcher, task: str
    ) -> tuple[list[str], np.ndarray, np.ndarray | None]:
        """``(ids, predictions, labels or None)`` of every example of ``batcher`` in order, with ``model`` in
        eval mode (restored afterwards)."""
        was_training = model.training
        model.eval()
        index = self.args.task_list.index(task)
        ids, preds, labels = [], [], []
        device = next(model.parameters()).device
        batcher.set_epoch(0)
        for batch in batcher:
            out = model(**self._inputs(batch, index, device))
            preds.append(model.predict(out).cpu().numpy())
            ids.extend(batch["ids"])
            if "labels" in batch:
                labels.append(batch["labels"].numpy())
        model.train(was_training)
        return ids, np.concatenate(preds), (np.concatenate(labels) if labels else None)

    def evaluate(self, model: torch.nn.Module | None = None) -> tuple[dict[str, float], dict[str, Any]]:
        """Dev metrics ``{task: accuracy or Pearson r, "overall": ...}`` and the predictions per task."""
        from fastpals.metrics import accuracy, pearson

        model = model if model is not None else self._eval_model()
        t0 = time.perf_counter()
        dev: dict[str, float] = {}
        preds: dict[str, Any] = {}
        for t, batcher in self.dev_batchers.items():
            ids, p, y = self.predict_batches(model, batcher, t)
            if TASKS[t].metric == "pearson":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    dev[t] = pearson(p, y)
            else:
                dev[t] = accuracy(y.astype(np.int64), p.astype(np.int64))
            preds[t] = (ids, p, y)
        dev["overall"] = overall_from(dev)
        self.timings["eval_s"] = self.timings.get("eval_s", 0.0) + time.perf_counter() - t0
        return dev, preds

    def _eval_and_track(self, epoch: int) -> dict[str, float]:
        dev, preds = self.evaluate()
        entry = {"type": "eval", "step": self.global_step, "epoch": epoch, "dev": dev}
        self.evals.append(entry)
        self.record(entry)
        if self._tb is not None:
            for k, v in dev.items():
                self._tb.add_scalar(f"dev/{k}", v, self.global_step)
        self.log(
            f"[eval] step {self.global_step} epoch {epoch}: "
            + ", ".join(f"{k} {v:.4f}" for k, v in dev.items())
        )
        if dev["overall"] > self.best["overall"]:
            self.best = {"overall": dev["overall"], "step": self.global_step, "epoch": epoch, "dev": dev}
            if self.is_main:
                self._save_best()
                self._write_dev_predictions(preds)
        return dev

    def _save_best(self) -> None:
        best = self.out / "best"
        self.engine.module.save_pretrained(best, tokenizer=self.tokenizer)
        shutil.copy(self.tokenizer.vocab_file, best / "vocab.txt")
        info = {"max_length": self.args.max_length, "step": self.global_step, "tasks": self.args.task_list}
        (best / "training_args.json").write_text(json.dumps(info, indent=2))

    def _write_dev_predictions(self, preds: dict[str, Any]) -> None:
        from fastpals.metrics import write_predictions

        for t, (ids, p, _) in preds.items():
            values = p.astype(np.int64) if TASKS[t].metric == "accuracy" else p.astype(np.float64)
            write_predictions(self.out / "predictions" / f"{t}-dev-output.csv", ids, values, t)
        np.savez(
            self.out / "predictions" / "dev_labels_and_predictions.npz",
            **{f"{t}_pred": p for t, (_, p, _) in preds.items()},
            **{f"{t}_label": y for t, (_, _, y) in preds.items()},
        )

    # --- one update ---------------------------------------------------------------------------------------------
    def _inputs(self, batch: dict, task_index: int, device: torch.device) -> dict[str, torch.Tensor]:
        keys = (
            "input_ids",
            "attention_mask",
            "token_type_ids",
            "input_ids_b",
            "attention_mask_b",
            "token_type_ids_b",
        )
        inputs = {k: batch[k].to(device) for k in keys if k in batch}
        n = batch["input_ids"].shape[0]
        inputs["task_ids"] = torch.full((n,), task_index, dtype=torch.long, device=device)
        return inputs

    def _micro_step(self, task_index: int) -> tuple[float, int]:
        task = self.args.task_list[task_index]
        batch = self.train_batchers[task].next_batch()
        out = self.engine(**self._inputs(batch, task_index, self.device))
        loss, _ = self.engine.module.loss(out, batch["labels"].to(self.device).float())
        if self.args.inject_nan_at_step == self.global_step + 1:
            loss = loss * float("nan")
        value = loss.item()
        if not math.isfinite(value):
            self.record({"type": "nonfinite", "step": self.global_step + 1, "task": task, "loss": value})
            raise NonFiniteLossError(self.global_step + 1, task, value)
        self.engine.backward(loss)
        return value, batch["input_ids"].shape[0]

    def train_update(self, group: list[int]) -> dict[str, Any]:
        """One optimizer update over the micro-batches of ``group`` (task indices)."""
        losses: dict[str, list[float]] = {}
        examples = 0
        if self.surgery_buffer is None:
            for t in group:
                value, n = self._micro_step(t)
                losses.setdefault(self.args.task_list[t], []).append(value)
                examples += n
                self.engine.step()  # DeepSpeed updates only at the accumulation boundary
        else:
            from fastpals.surgery import gem_weights, pcgrad_weights

            captured = set()
            for t in group:
                value, n = self._micro_step(t)
                losses.setdefault(self.args.task_list[t], []).append(value)
                examples += n
                self.surgery_buffer.capture(t, accumulate=t in captured)
                captured.add(t)
            aggregator = pcgrad_weights if self.args.surgery == "pcgrad" else gem_weights
            result = self.surgery_buffer.apply(aggregator, generator=self.surgery_generator)
            if result.skipped:
                bad = [self.args.task_list[i] for i in result.nonfinite_tasks] or ["task-specific"]
                self.record(
                    {"type": "nonfinite", "step": self.global_step + 1, "task": bad, "what": "gradient"}
                )
                raise NonFiniteLossError(self.global_step + 1, ",".join(bad), math.nan, "task gradient")
            self.engine.step()
        self.global_step += 1
        return {
            "loss": {t: float(np.mean(v)) for t, v in losses.items()},
            "examples": examples,
        }

    # --- signals ------------------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop_signal = signum

    # --- the run ------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        args = self.args
        start = time.perf_counter()
        self.out.mkdir(parents=True, exist_ok=True)
        self._setup_data()
        self._setup_model()
        self._setup_engine()
        self._tb = None
        if self.is_main:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out / "tensorboard"))
            except ImportError:
                self.log("[log] tensorboard is not installed: metrics go to metrics.jsonl only")
        if args.resume:
            self.load_checkpoint()
        else:
            (self.out / "metrics.jsonl").unlink(missing_ok=True)
            from fastpals.multitask import count_parameters

            self.record({"type": "config", "args": _jsonable(vars(args)), "ds_config": self.ds_config,
                         "parameters": count_parameters(self.model)})  # fmt: skip
        setup_s = time.perf_counter() - start
        self.timings["setup_s"] = self.timings.get("setup_s", 0.0) + setup_s
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            if args.eval_at_start and self.untrained is None:
                self.untrained, _ = self.evaluate()
                self.record({"type": "eval", "step": 0, "epoch": 0, "dev": self.untrained, "untrained": True})
                self.log(
                    "[eval] untrained (step 0): "
                    + ", ".join(f"{k} {v:.4f}" for k, v in self.untrained.items())
                )
            self._loop()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if self._tb is not None:
                self._tb.close()
        return self._finish(start)

    def _loop(self) -> None:
        from tqdm import tqdm

        args, sampler = self.args, self.sampler
        self.engine.train()
        t_train = time.perf_counter()
        ema: dict[str, float] = {}
        while True:
            if sampler.epoch_done():
                if self.evaluated_epoch < sampler.epoch:
                    self._end_epoch()
                if sampler.epoch == args.epochs:
                    break
                sampler.start_next_epoch()
            done = math.ceil(sampler.position / sampler.group_size)
            self._bar = tqdm(
                total=sampler.updates_per_epoch, initial=done, desc=f"epoch {sampler.epoch}/{args.epochs}",
                disable=args.no_progress or not self.is_main, file=sys.stderr, dynamic_ncols=True,
                mininterval=1.0,
            )  # fmt: skip
            while not sampler.epoch_done():
                group = sampler.next_update()
                t0 = time.perf_counter()
                stats = self.train_update(group)
                dt = time.perf_counter() - t0
                lr = self.scheduler.get_last_lr()
                entry = {
                    "type": "step", "step": self.global_step, "epoch": sampler.epoch, "loss": stats["loss"],
                    "lr": lr, "examples_per_s": stats["examples"] / dt, "seconds": dt,
                }  # fmt: skip
                self.record(entry)
                for t, v in stats["loss"].items():
                    self.step_losses[t][0].append(self.global_step)
                    self.step_losses[t][1].append(v)
                    ema[t] = v if t not in ema else 0.9 * ema[t] + 0.1 * v
                    if self._tb is not None:
                        self._tb.add_scalar(f"train/loss_{t}", v, self.global_step)
                if self._tb is not None:
                    self._tb.add_scalar("train/lr", lr[0], self.global_step)
                    self._tb.add_scalar("train/examples_per_s", entry["examples_per_s"], self.global_step)
                self._bar.set_postfix(
                    {**{t: f"{v:.3f}" for t, v in ema.items()}, "ex/s": f"{entry['examples_per_s']:.1f}"},
                    refresh=False,
                )
                self._bar.update(1)
                if args.eval_every and self.global_step % args.eval_every == 0 and not sampler.epoch_done():
                    self._eval_and_track(sampler.epoch)
                if args.stop_after_steps is not None and self.global_step == args.stop_after_steps:
                    os.kill(os.getpid(), signal.SIGTERM)
                if self._stop_signal is not None:
                    self._bar.close()
                    self._bar = None
                    self.timings["train_s"] = self.timings.get("train_s", 0.0) + time.perf_counter() - t_train
                    path = self.save_checkpoint()
                    self.record(
                        {"type": "interrupted", "step": self.global_step, "signal": self._stop_signal}
                    )
                    raise TrainingInterrupted(self._stop_signal, self.global_step, path)
            self._bar.close()
            self._bar = None
        self.timings["train_s"] = self.timings.get("train_s", 0.0) + time.perf_counter() - t_train

    def _end_epoch(self) -> None:
        epoch = self.sampler.epoch
        dev = self._eval_and_track(epoch)
        self.evaluated_epoch = epoch
        self.record({"type": "epoch", "epoch": epoch, "step": self.global_step, "dev": dev})
        self.save_checkpoint()

    def _finish(self, start: float) -> dict[str, Any]:
        args = self.args
        results: dict[str, Any] = {
            "dev": self.best["dev"],
            "best_step": self.best["step"],
            "best_epoch": self.best["epoch"],
            "untrained_dev": self.untrained,
            "evals": self.evals,
            "steps": self.global_step,
            "quora_note": "para dev = the held-out 10% (sha256 of id) split of quora-dev.csv; trained on the rest",
            "config": _jsonable({k: v for k, v in vars(args).items() if k not in ("pal_config",)}),
            "pal_config": None if args.pal_config is None else args.pal_config.to_dict(),
            "ds_config": self.ds_config,
            "zero_stage": self.zero_stage,
        }
        if self.is_main:
            t0 = time.perf_counter()
            self._write_outputs()
            self.timings["outputs_s"] = time.perf_counter() - t0
            self.timings["total_s_this_process"] = time.perf_counter() - start
            results["timings"] = self.timings
            (self.out / "results.json").write_text(json.dumps(results, indent=2))
            print(results_table(results), flush=True)
        return results

    def _write_outputs(self) -> None:
        from fastpals.metrics import write_predictions
        from fastpals.plots import plot_confusion_matrices, plot_training_curves

        untrained = [{"step": 0, "dev": self.untrained}] if self.untrained else []
        plot_training_curves(
            self.step_losses,
            untrained + list(self.evals),
            self.out / "training_curves.png",
            title=f"{self.args.pal} / {self.args.sampling} / {self.args.surgery}",
        )
        npz = self.out / "predictions" / "dev_labels_and_predictions.npz"
        if npz.is_file():
            data = np.load(npz)
            plot_confusion_matrices(
                {
                    t: (data[f"{t}_label"], data[f"{t}_pred"])
                    for t in self.args.task_list
                    if f"{t}_pred" in data
                },
                self.out,
            )
        best = MultiTaskBert.load(self.out / "best").to(self.device)
        for t in self.args.task_list:
            if "test" not in TASK_FORMATS[t].files:
                continue
            test = _load_split(t, "test", self.args.data_path, self.args.max_predict, self.log)
            batcher = TaskBatcher(
                test, self.tokenizer, t, max(self.args.batch_size, 64), max_length=self.args.max_length,
                shuffle=False, bucket_by_length=False, pair_encoding=self.pair_encoding[t],
            )  # fmt: skip
            ids, p, _ = self.predict_batches(best, batcher, t)
            values = p.astype(np.int64) if TASKS[t].metric == "accuracy" else p.astype(np.float64)
            write_predictions(self.out / "predictions" / f"{t}-test-output.csv", ids, values, t)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, (str, int, float, bool, type(None))):
            out[k] = v
        elif isinstance(v, (list, tuple)):
            out[k] = [x if isinstance(x, (str, int, float, bool)) else str(x) for x in v]
        else:
            out[k] = str(v)
    return out


def results_table(results: dict[str, Any]) -> str:
    """A plain-text table of the best dev scores (and the untrained ones when measured)."""
    dev = results.get("dev") or {}
    untrained = results.get("untrained_dev") or {}
    lines = [f"{'dev metric':<22}{'best':>10}" + (f"{'untrained':>12}" if untrained else "")]
    for k, v in dev.items():
        name = {
            "sst": "sst accuracy",
            "para": "para accuracy*",
            "sts": "sts pearson",
            "cfimdb": "cfimdb accuracy",
        }.get(k, k)
        lines.append(f"{name:<22}{v:>10.4f}" + (f"{untrained.get(k, math.nan):>12.4f}" if untrained else ""))
    lines.append(f"(best at update step {results.get('best_step')}, epoch {results.get('best_epoch')}; "
                 "*para dev = held-out 10% of quora-dev.csv)")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``train.py`` and ``fastpals train``; returns the exit status (0 ok, 2 bad option or
    config, 3 non-finite loss, 128 + signal number when stopped by SIGTERM/SIGINT after checkpointing)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        trainer = Trainer(args)
        trainer.run()
    except ConfigError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    except NonFiniteLossError as err:
        print(f"train.py: {err}", file=sys.stderr)
        return 3
    except TrainingInterrupted as err:
        print(f"train.py: {err}", file=sys.stderr)
        return 128 + err.signum
    return 0
