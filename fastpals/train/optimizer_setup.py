"""A run's model, its optimizer parameter groups, the optimizers and the warm-up/decay schedule."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np
import torch

from fastpals.encoder.bert import freeze_shared_parameters, is_task_specific, task_specific_kind
from fastpals.model.multitask import MultiTaskBert
from fastpals.train.errors import ConfigError

__all__ = ["build_model", "freeze_bottom_layers", "lr_lambda", "make_optimizer", "optimizer_param_groups"]

OPTIMIZERS = ("adamw", "sgd", "rmsprop")


def _no_decay(name: str) -> bool:
    leaf = name.split(".")[-1]
    norm = "LayerNorm" in name or "layer_norm" in name or leaf.startswith("ln_")
    return norm or leaf.endswith("bias") or leaf == "gate"


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
    return [
        {"params": groups[kind, decay], "lr": rates[kind], "weight_decay": weight_decay if decay else 0.0,
         "name": f"{kind}{'' if decay else '_no_decay'}"}
        for kind in ("encoder", "pal", "head")
        for decay in (True, False)
        if groups.get((kind, decay))
    ]  # fmt: skip


def make_optimizer(groups: list[dict[str, Any]], name: str) -> torch.optim.Optimizer:
    """``adamw`` (betas 0.9/0.999, eps 1e-6; fused where every parameter is a floating CPU or CUDA
    tensor), ``sgd`` (momentum 0.9) or ``rmsprop`` over ``groups``."""
    if name == "adamw":
        params = [p for g in groups for p in g["params"]]
        fused = bool(params) and all(
            p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params
        )
        return torch.optim.AdamW(groups, betas=(0.9, 0.999), eps=1e-6, fused=fused or None)
    if name == "sgd":
        return torch.optim.SGD(groups, momentum=0.9)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, alpha=0.99, eps=1e-8)
    raise ConfigError(f"--optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")


def lr_lambda(step: int, total: int, warmup: float) -> float:
    """Multiplier of the peak learning rate for update ``step`` (from 0) of ``total``: linear warm-up over
    ``round(warmup * total)`` updates (``(step + 1) / w``), then linear decay reaching 0 after ``total``."""
    w = int(round(warmup * total))
    return (step + 1) / w if step < w else max(0.0, (total - step) / max(1, total - w))


def build_model(args: Any) -> torch.nn.Module:
    """The :class:`~fastpals.MultiTaskBert` of a run's options, seeded with ``--seed``, with the freezing
    options applied; a model that cannot be loaded is a :class:`ConfigError`."""
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed)
    specs = []
    for t in args.task_list:
        spec = args.task_specs[t]
        mode = args.pair_mode
        if spec.pair and mode != "joint":
            if mode == "sbert_cosine" and not spec.task_kind.cosine_pairs:
                mode = "sbert_concat"
            spec = dataclasses.replace(spec, pair_mode=mode)
        specs.append(dataclasses.replace(spec, head=args.head))
    try:
        model = MultiTaskBert.from_pretrained(args.model, tasks=specs, pal=args.pal_config)
    except (FileNotFoundError, OSError, ImportError, ValueError) as err:
        raise ConfigError(f"--model {args.model}: {err}") from None
    if args.pal_config is not None:
        try:
            args.pal_config.validate(model.config.bert.num_hidden_layers)
        except ValueError as err:
            raise ConfigError(f"--pal {args.pal}: {err}") from None
    if args.freeze_bert:
        freeze_shared_parameters(model)  # only PALs, heads and LayerNorms train
    if args.freeze_word_embeddings:
        if hasattr(model.bert, "model"):  # an HF encoder (fastpals.model.hf_encoder.HFEncoder)
            model.bert.model.get_input_embeddings().weight.requires_grad_(False)
        else:
            model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    if args.freeze_layers:
        freeze_bottom_layers(model, args.freeze_layers)
    if getattr(args, "activation_checkpointing", False):
        model.bert.set_activation_checkpointing(True)
    return model


def freeze_bottom_layers(model: torch.nn.Module, k: int) -> None:
    """``--freeze-layers K``: no gradient for the embeddings and encoder layers ``0 .. K-1`` (the backward
    stops at layer K); a task-specific parameter there is a :class:`ConfigError` naming it."""
    if not hasattr(model.bert, "encoder"):
        raise ConfigError(
            f"--freeze-layers {k}: only BERT checkpoints (fastpals' minBERT) support it; this run's encoder is "
            f"the HF {getattr(model.bert, 'model_type', type(model.bert).__name__)} (use --freeze-bert or no freezing)"
        )
    layers = model.bert.encoder.layer
    if not 0 <= k <= len(layers):
        raise ConfigError(
            f"--freeze-layers {k}: the encoder has {len(layers)} layers; choose 0..{len(layers)}"
        )
    frozen = [("bert.embeddings", model.bert.embeddings)]
    frozen += [(f"bert.encoder.layer.{i}", layers[i]) for i in range(k)]
    for prefix, module in frozen:
        for name, p in module.named_parameters():
            if is_task_specific(f"{prefix}.{name}"):
                raise ConfigError(
                    f"--freeze-layers {k} would freeze the task-specific {prefix}.{name}: put the PALs in the "
                    f"layers above with --pal-layers {len(layers) - k} (or freeze fewer layers)"
                )
            p.requires_grad_(False)
