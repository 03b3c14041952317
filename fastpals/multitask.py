"""The multi-task model: a (PAL-)BERT encoder, one head per task, losses, predictions, save and load.

Tasks are declared with :class:`fastpals.tasks.TaskSpec` (kind, single sentence or pair, head, pooling, loss,
files, metric), so users can add tasks beyond SST / Quora / STS. A batch may mix tasks: ``task_ids [B]`` says
which task each example belongs to, every example goes through its own task's PALs and head in one call.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastpals.model import BertConfig, BertModel, PALConfig, _is_task_param, state_dict_mismatches
from fastpals.tasks import TASKS, TaskSpec, get_task

__all__ = [
    "TASKS",
    "MultiTaskBert",
    "MultiTaskConfig",
    "MultiTaskOutput",
    "TaskSpec",
    "count_parameters",
    "get_task",
]


@dataclass
class MultiTaskConfig:
    """Everything needed to rebuild a :class:`MultiTaskBert`: the encoder config, the tasks, the PAL config
    (None = no PALs), and the base checkpoint it was fine-tuned from (for adapter-only saves)."""

    bert: BertConfig
    tasks: list[TaskSpec]
    pal: PALConfig | None = None
    base_model: str | None = None
    head_dropout: float = 0.1
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "bert": dataclasses.asdict(self.bert),
            "tasks": [t.to_dict() for t in self.tasks],
            "pal": None if self.pal is None else self.pal.to_dict(),
            "base_model": self.base_model,
            "head_dropout": self.head_dropout,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MultiTaskConfig:
        return cls(
            bert=BertConfig.from_dict(d["bert"]),
            tasks=[TaskSpec(**t) for t in d["tasks"]],
            pal=None if d.get("pal") is None else PALConfig.from_dict(d["pal"]),
            base_model=d.get("base_model"),
            head_dropout=d.get("head_dropout", 0.1),
            extra=d.get("extra", {}),
        )


class TaskHead(nn.Module):
    """Maps pooled features ``[n, in]`` to ``[n, num_labels]``."""

    def __init__(self, spec: TaskSpec, d: int, dropout: float) -> None:
        super().__init__()
        width = 3 * d if spec.pair_mode == "sbert_concat" else d
        self.dropout = nn.Dropout(dropout)
        if spec.head == "mlp":
            self.mlp = nn.Sequential(nn.Linear(width, d), nn.GELU(), nn.Dropout(dropout))
            width = d
        else:
            self.mlp = None
        self.out = nn.Linear(width, spec.num_labels)
        nn.init.normal_(self.out.weight, std=0.02)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x)
        if self.mlp is not None:
            x = self.mlp(x)
        return self.out(x)


@dataclass
class MultiTaskOutput:
    """``logits [B, C]`` (C = the largest ``num_labels``; row b's first ``num_labels`` of its task are valid,
    the rest 0), ``task_ids [B]``, and the encoder's ``pooled [B, d]`` features of the first sentence."""

    logits: torch.Tensor
    task_ids: torch.Tensor
    pooled: torch.Tensor


class MultiTaskBert(nn.Module):
    """A (PAL-)BERT encoder with one head per task. ``MultiTaskBert(config)`` is randomly initialised;
    :meth:`from_pretrained` loads the encoder from a checkpoint."""

    def __init__(self, config: MultiTaskConfig) -> None:
        super().__init__()
        if not config.tasks:
            raise ValueError("MultiTaskBert needs at least one task")
        names = [t.name for t in config.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"task names must be distinct, got {names}")
        if config.pal is not None and config.pal.num_tasks != len(config.tasks):
            config.pal = dataclasses.replace(config.pal, num_tasks=len(config.tasks))
        self.config = config
        self.tasks = list(config.tasks)
        self.bert = BertModel(config.bert, pal=config.pal)
        d = config.bert.hidden_size
        self.heads = nn.ModuleDict({t.name: TaskHead(t, d, config.head_dropout) for t in self.tasks})

    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        tasks: list[str | TaskSpec] | tuple[str | TaskSpec, ...] = ("sst", "para", "sts"),
        pal: PALConfig | None = None,
        head_dropout: float = 0.1,
    ) -> MultiTaskBert:
        """Encoder weights from ``name_or_path`` (see :meth:`BertModel.from_pretrained`), random PALs and heads."""
        specs = [get_task(t) for t in tasks]
        if pal is not None:
            pal = dataclasses.replace(pal, num_tasks=len(specs))
        encoder = BertModel.from_pretrained(name_or_path, pal=pal)
        config = MultiTaskConfig(encoder.config, specs, pal, str(name_or_path), head_dropout)
        model = cls(config)
        model.bert.load_state_dict(encoder.state_dict())
        model.bert.load_report = encoder.load_report
        return model

    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]

    def task_index(self, name: str) -> int:
        try:
            return self.task_names.index(name)
        except ValueError:
            raise ValueError(f"unknown task {name!r}; this model has {self.task_names}") from None

    # ------------------------------------------------------------------------------------------------------------
    def _features(self, spec: TaskSpec, out: Any, mask: torch.Tensor) -> torch.Tensor:
        if spec.pooling == "cls":
            return out.pooler_output
        h = out.last_hidden_state
        m = mask.to(h.dtype).unsqueeze(-1)
        if spec.pooling == "mean":
            return (h * m).sum(1) / m.sum(1).clamp_min(1.0)
        return h.masked_fill(m == 0, torch.finfo(h.dtype).min).amax(1)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        task_ids: torch.Tensor | None = None,
        input_ids_b: torch.Tensor | None = None,
        attention_mask_b: torch.Tensor | None = None,
        token_type_ids_b: torch.Tensor | None = None,
        unpad: bool = False,
    ) -> MultiTaskOutput:
        """input_ids etc. ``[B, L]``; task_ids ``[B]`` int64 (may be omitted for a one-task model).

        Siamese pair tasks (``pair_mode`` sbert_*) take the second sentences in ``*_b`` ``[B, L2]`` (rows of other
        tasks are ignored there). Returns :class:`MultiTaskOutput`.
        """
        b = input_ids.shape[0]
        if task_ids is None:
            if len(self.tasks) != 1:
                raise ValueError("task_ids is required for a model with more than one task")
            task_ids = torch.zeros(b, dtype=torch.long, device=input_ids.device)
        from fastpals.functional import check_task_ids

        task_ids = check_task_ids(task_ids, len(self.tasks), b, input_ids.device)
        enc_tasks = task_ids if self.bert.num_tasks else None
        out_a = self.bert(input_ids, attention_mask, token_type_ids, enc_tasks, unpad=unpad)
        present = torch.bincount(task_ids, minlength=len(self.tasks)).tolist()  # one host sync per batch
        out_b = None
        if any(present[i] and s.siamese for i, s in enumerate(self.tasks)):
            if input_ids_b is None or attention_mask_b is None:
                raise ValueError("siamese pair tasks need input_ids_b and attention_mask_b")
            out_b = self.bert(input_ids_b, attention_mask_b, token_type_ids_b, enc_tasks, unpad=unpad)
        width = max(t.num_labels for t in self.tasks)
        logits = out_a.pooler_output.new_zeros(b, width)
        for i, spec in enumerate(self.tasks):
            if not present[i]:
                continue
            idx = (task_ids == i).nonzero(as_tuple=True)[0]
            u = self._features(spec, out_a, attention_mask).index_select(0, idx)
            if spec.siamese:
                v = self._features(spec, out_b, attention_mask_b).index_select(0, idx)
                if spec.pair_mode == "sbert_cosine":
                    logits = logits.index_put((idx, torch.zeros_like(idx)), F.cosine_similarity(u, v, dim=-1))
                    continue
                u = torch.cat([u, v, (u - v).abs()], dim=-1)
            y = self.heads[spec.name](u)
            logits = logits.index_copy(0, idx, F.pad(y, (0, width - spec.num_labels)))
        return MultiTaskOutput(logits=logits, task_ids=task_ids, pooled=out_a.pooler_output)

    def loss(
        self, output: MultiTaskOutput, labels: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sum over the tasks present of each task's mean loss, and the per-task losses.

        labels ``[B]`` float (class index for classification, 0/1 for binary, the raw label for regression).
        """
        total = output.logits.new_zeros(())
        per_task: dict[str, torch.Tensor] = {}
        for i, spec in enumerate(self.tasks):
            idx = (output.task_ids == i).nonzero(as_tuple=True)[0]
            if idx.numel() == 0:
                continue
            z = output.logits.index_select(0, idx)[:, : spec.num_labels]
            y = labels.index_select(0, idx)
            if spec.kind == "classification":
                loss = F.cross_entropy(z.float(), y.long())
            elif spec.kind == "binary":
                loss = F.binary_cross_entropy_with_logits(z[:, 0].float(), y.float())
            elif spec.loss == "mse":
                loss = F.mse_loss(z[:, 0].float(), y.float() / spec.label_scale)
            else:
                loss = _cosent_loss(z[:, 0].float(), y.float())
            per_task[spec.name] = loss
            total = total + loss
        return total, per_task

    def predict(self, output: MultiTaskOutput) -> torch.Tensor:
        """Predicted labels ``[B]`` float: class index, 0/1, or the regression value clipped to the label range."""
        preds = output.logits.new_zeros(output.logits.shape[0], dtype=torch.float32)
        for i, spec in enumerate(self.tasks):
            rows = output.task_ids == i
            z = output.logits[:, : spec.num_labels].float()
            if spec.kind == "classification":
                p = z.argmax(-1).float()
            elif spec.kind == "binary":
                p = (z[:, 0] > 0).float()
            else:
                p = z[:, 0].clamp(0.0, 1.0) * spec.label_scale
            preds = torch.where(rows, p, preds)
        return preds

    # ------------------------------------------------------------------------------------------------------------
    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The task-specific weights alone: PALs (every variant) and heads."""
        return {k: v for k, v in self.state_dict().items() if k.startswith("heads.") or _is_task_param(k)}

    def save_pretrained(self, folder: str | os.PathLike, adapters_only: bool = False) -> Path:
        """Write ``fastpals_config.json`` and ``model.safetensors`` (everything) or ``adapters.safetensors``
        (PAL and head weights alone; loading them needs the base checkpoint named in the config)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = self.config.to_dict()
        meta["format"] = "adapters" if adapters_only else "full"
        (folder / "fastpals_config.json").write_text(json.dumps(meta, indent=2))
        state = self.adapter_state_dict() if adapters_only else self.state_dict()
        name = "adapters.safetensors" if adapters_only else "model.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(folder / name))
        return folder

    @classmethod
    def load(cls, folder: str | os.PathLike, base_model: str | os.PathLike | None = None) -> MultiTaskBert:
        """Load what :meth:`save_pretrained` wrote. Adapter-only folders load the encoder from ``base_model``
        (default: the one recorded in the config) and then the adapters; any mismatch is an error."""
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg_path = folder / "fastpals_config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(
                f"{cfg_path} not found: not a folder written by MultiTaskBert.save_pretrained"
            )
        meta = json.loads(cfg_path.read_text())
        config = MultiTaskConfig.from_dict(meta)
        if meta.get("format") == "adapters":
            base = base_model or config.base_model
            if base is None:
                raise ValueError(f"{folder} holds adapters only: pass base_model=")
            model = cls.from_pretrained(base, config.tasks, config.pal, config.head_dropout)
            _load_checked(model, load_file(str(folder / "adapters.safetensors")), folder, subset=True)
        else:
            model = cls(config)
            _load_checked(model, load_file(str(folder / "model.safetensors")), folder, subset=False)
        return model


def _load_checked(model: nn.Module, state: dict[str, torch.Tensor], folder: Path, subset: bool) -> None:
    own = model.state_dict()
    if subset:
        own = {k: v for k, v in own.items() if k.startswith("heads.") or _is_task_param(k)}
    problems = state_dict_mismatches(own, state)
    if problems:
        raise ValueError(f"cannot load {folder}:\n  " + "\n  ".join(problems))
    model.load_state_dict(state, strict=not subset)


def _cosent_loss(scores: torch.Tensor, labels: torch.Tensor, scale: float = 20.0) -> torch.Tensor:
    """CoSENT: log(1 + Σ_{y_i > y_j} exp(s · (p_j − p_i))) over the pairs of a batch."""
    diff = scale * (scores[None, :] - scores[:, None])  # [i, j] = s (p_j - p_i)
    keep = labels[:, None] > labels[None, :]
    diff = diff.masked_fill(~keep, float("-inf"))
    return torch.logsumexp(torch.cat([diff.new_zeros(1), diff.flatten()]), 0)


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter counts by component (each shared tensor counted once).

    Keys: ``total``, ``encoder`` (the BERT weights), ``pal`` (all task-specific encoder parameters), ``heads``,
    and the PAL breakdown ``pal_projections``, ``pal_attention``, ``pal_gates``, ``pal_top``, ``embert``.
    """
    counts = dict.fromkeys(
        (
            "total",
            "encoder",
            "pal",
            "heads",
            "pal_projections",
            "pal_attention",
            "pal_gates",
            "pal_top",
            "embert",
        ),
        0,
    )
    for name, p in model.named_parameters():
        n = p.numel()
        counts["total"] += n
        if name.startswith("heads.") or ".heads." in name:
            counts["heads"] += n
        elif _is_task_param(name):
            counts["pal"] += n
            if "pal_top." in name:
                counts["pal_top"] += n
            elif name.endswith("task_embedding"):
                counts["embert"] += n
            elif name.endswith(".gate"):
                counts["pal_gates"] += n
            elif "qkv_" in name:
                counts["pal_attention"] += n
            else:
                counts["pal_projections"] += n
        else:
            counts["encoder"] += n
    return counts
