"""The multi-task model: a (PAL-)BERT encoder and one head per task (a batch may mix tasks), save and load."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from fastpals.adapters.format import (
    ADAPTER_SUBFOLDER,
    check_same_pal_config,
    find_adapter_folder,
    load_adapter_tensors,
    read_adapter,
    read_adapter_config,
    trained_base_in_encoder,
    write_adapter,
)
from fastpals.adapters.targets import TARGETS
from fastpals.data.layout import BatchLayout, layout_from_cu_seqlens
from fastpals.data.tasks import TASKS, TaskSpec, get_task
from fastpals.encoder.bert import BertConfig, BertModel, PALConfig, state_dict_mismatches, task_specific_kind
from fastpals.encoder.fingerprint import check_encoder_fingerprint, encoder_fingerprint, parameter_digests
from fastpals.encoder.pal_variants import pal_count_categories, pal_parameter_category
from fastpals.functional import check_task_ids
from fastpals.model.heads import (
    TASK_WEIGHTINGS,
    MultiTaskOutput,
    TaskHead,
    TaskLosses,
    predict,
    summed_loss,
    take_rows,
    task_losses,
)
from fastpals.model.hf_encoder import HFEncoder, runs_as_minbert
from fastpals_kernels.padding import pool_packed

__all__ = [
    "TASKS",
    "MultiTaskBert",
    "MultiTaskConfig",
    "MultiTaskOutput",
    "TASK_WEIGHTINGS",
    "TaskLosses",
    "TaskSpec",
    "count_parameters",
    "get_task",
]


@dataclass
class MultiTaskConfig:
    """What rebuilds a :class:`MultiTaskBert`: encoder config, tasks, PAL config (None: no PALs), base checkpoint."""

    bert: BertConfig
    tasks: list[TaskSpec]
    pal: PALConfig | None = None
    base_model: str | None = None
    head_dropout: float = 0.1
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tasks": [t.to_dict() for t in self.tasks]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MultiTaskConfig:
        pal = None if d.get("pal") is None else PALConfig.from_dict(d["pal"])
        rest = {k: d[k] for k in ("base_model", "head_dropout", "extra") if k in d}
        return cls(BertConfig.from_dict(d["bert"]), [TaskSpec(**t) for t in d["tasks"]], pal, **rest)


class MultiTaskBert(nn.Module):
    """A (PAL-)BERT encoder with one head per task: ``MultiTaskBert(config)`` (random), :meth:`from_base`."""

    builds_own_pals = True  # inject_pals / save_pals / load_pals call this model's own methods

    def __init__(self, config: MultiTaskConfig, encoder: nn.Module | None = None) -> None:
        """``encoder``: an :class:`HFEncoder` whose config is ``config.bert``, in place of minBERT."""
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
        self.bert = BertModel(config.bert, pal=config.pal) if encoder is None else encoder
        d = config.bert.hidden_size
        self.heads = nn.ModuleDict({t.name: TaskHead(t, d, config.head_dropout) for t in self.tasks})

    @classmethod
    def from_base(
        cls,
        name_or_path: str | os.PathLike,
        tasks: list[str | TaskSpec] | tuple[str | TaskSpec, ...] = ("sst", "para", "sts"),
        pal: PALConfig | None = None,
        head_dropout: float = 0.1,
    ) -> MultiTaskBert:
        """A new model on the encoder checkpoint ``name_or_path`` (``"minilm-l6"``, a folder, a Hub name) with
        fresh PALs (``num_tasks`` set to ``len(tasks)``) and heads, in eval mode: call ``.train()`` to train."""
        specs = [get_task(t) for t in tasks]
        if pal is not None:
            pal = dataclasses.replace(pal, num_tasks=len(specs))
        if not runs_as_minbert(name_or_path):  # another architecture: the HF model with injected PALs
            hf = HFEncoder.from_pretrained(name_or_path, pal=pal)
            config = MultiTaskConfig(hf.config, specs, pal, str(name_or_path), head_dropout)
            config.extra["hf_model_type"] = hf.model_type
            return cls(config, encoder=hf).eval()
        encoder = BertModel.from_pretrained(name_or_path, pal=pal)
        config = MultiTaskConfig(encoder.config, specs, pal, str(name_or_path), head_dropout)
        model = cls(config)
        model.bert.load_state_dict(encoder.state_dict())
        model.bert.load_report = encoder.load_report
        model.base_digests = parameter_digests(model.bert)  # to tell at save time whether the encoder trained
        return model.eval()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike,
        tasks: list[str | TaskSpec] | tuple[str | TaskSpec, ...] | None = None,
        pal: PALConfig | None = None,
        head_dropout: float = 0.1,
        base_model: str | os.PathLike | None = None,
        force: bool = False,
    ) -> MultiTaskBert:
        """Open a :meth:`save_pretrained` folder in eval mode, full or adapter-only (on ``base_model``,
        default the recorded one); :func:`fastpals.save_pals`' adapters need ``tasks=``; a base checkpoint
        with ``tasks=``: :meth:`from_base`."""
        folder = Path(name_or_path)
        if not (folder.is_dir() and find_adapter_folder(folder) is not None):
            if folder.is_dir() and (folder / LEGACY_CONFIG_NAME).is_file():
                if tasks is not None or pal is not None:
                    raise ValueError(
                        f"{folder} is a saved MultiTaskBert: its tasks and PALs are fixed (drop tasks=/pal=)"
                    )
                warnings.warn(
                    f"{folder} is in the old fastpals format ({LEGACY_CONFIG_NAME}); save it again with "
                    "save_pretrained to get config.json, model.safetensors and pals/adapter_*",
                    FutureWarning,
                    stacklevel=2,
                )
                meta = json.loads((folder / LEGACY_CONFIG_NAME).read_text())
                legacy = MultiTaskConfig.from_dict(meta)
                if meta.get("format") != "adapters":  # model.safetensors: all weights
                    model = cls(legacy)
                    _load_exact(model, load_file(str(folder / "model.safetensors")), folder)
                    return model.eval()
                if (base := base_model or legacy.base_model) is None:
                    raise ValueError(f"{folder} holds adapters only: pass base_model=")
                model = cls.from_base(base, legacy.tasks, legacy.pal, legacy.head_dropout)
                weights = load_file(str(folder / "adapters.safetensors"))
                _load_exact(model, weights, folder, task_specific=True)
                return model.eval()
            if tasks is None:
                raise ValueError(
                    f"{name_or_path} is not a saved MultiTaskBert (no adapter_config.json): to start a new "
                    "model from a base checkpoint call MultiTaskBert.from_base(name_or_path, tasks=[...], "
                    "pal=...)"
                )
            return cls.from_base(name_or_path, tasks, pal, head_dropout)
        config, adapter = read_adapter_config(folder, "MultiTaskBert.from_pretrained")
        saved_pal = None if config.get("pal_config") is None else PALConfig.from_dict(config["pal_config"])
        if pal is not None:
            raise ValueError(
                f"{folder} is a saved model: its PALs are fixed by {adapter}/adapter_config.json (drop pal=)"
            )
        saved = config.get("extra", {})
        if config.get("tasks") is not None:
            if tasks is not None:
                raise ValueError(f"{folder} is a saved MultiTaskBert: its tasks are fixed (drop tasks=)")
            specs = [TaskSpec(**t) for t in config["tasks"]]
            head_dropout = saved.get("head_dropout", head_dropout)
        elif tasks is None:
            raise ValueError(
                f"the adapter in {adapter} holds PALs for {config.get('task_names')} but no task heads "
                "(saved by save_pals): pass tasks=[...] (one per PAL task; the heads start fresh)"
            )
        else:
            specs = [get_task(t) for t in tasks]
        full = adapter != folder and (folder / "config.json").is_file()
        if full and saved.get("hf_model_type"):  # an HF encoder saved beside its adapter
            model = cls.from_base(folder, specs, saved_pal, head_dropout)
        elif full:
            bert_config = BertConfig.from_json(folder / "config.json")
            model = cls(MultiTaskConfig(bert_config, specs, saved_pal, None, head_dropout))
            path = folder / "model.safetensors"
            if not path.is_file():
                raise FileNotFoundError(f"{path} not found (a full model folder has it beside config.json)")
            _load_exact(model.bert, load_file(str(path)), path, task_specific=False)
        else:
            base = base_model or config.get("base_model_name_or_path")
            if base is None:
                raise ValueError(
                    f"{folder} holds an adapter only and records no base_model_name_or_path: pass base_model="
                )
            model = cls.from_base(base, specs, saved_pal, head_dropout)
        if full:
            model.config.base_model = saved.get("fine_tuned_from")
        model.config.extra = {k: v for k, v in saved.items() if k not in ("head_dropout", "fine_tuned_from")}
        model.load_adapter(adapter, strict=config.get("tasks") is not None, force=force)
        return model.eval()

    @classmethod
    def load(
        cls, folder: str | os.PathLike, base_model: str | os.PathLike | None = None, force: bool = False
    ) -> MultiTaskBert:
        """:meth:`from_pretrained` for saved folders (alias)."""
        return cls.from_pretrained(folder, base_model=base_model, force=force)

    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]

    def task_index(self, name: str) -> int:
        try:
            return self.task_names.index(name)
        except ValueError:
            raise ValueError(f"unknown task {name!r}; this model has {self.task_names}") from None

    def _features(self, spec: TaskSpec, out: Any, mask: Tensor | None = None) -> Tensor:
        """The task's pooled features ``[B, d]`` of an encoder output, packed, or padded with its ``mask``."""
        if spec.pooling == "cls":
            return out.pooler_output
        if out.cu_seqlens is not None:
            return pool_packed(out.last_hidden_state, out.cu_seqlens, spec.pooling)
        h = out.last_hidden_state
        m = mask.to(h.dtype).unsqueeze(-1)
        if spec.pooling == "mean":
            return (h * m).sum(1) / m.sum(1).clamp_min(1.0)
        return h.masked_fill(m == 0, torch.finfo(h.dtype).min).amax(1)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        task_ids: Tensor | None = None,
        input_ids_b: Tensor | None = None,
        attention_mask_b: Tensor | None = None,
        token_type_ids_b: Tensor | None = None,
        layout: BatchLayout | None = None,
        **deprecated: Any,
    ) -> MultiTaskOutput:
        """Every row through its task's PALs and head. Packed: int64 ``[N]`` tensors and the batch's
        ``layout`` (:func:`fastpals.data.model_inputs`), the siamese second sentences ``*_b [N2]`` laid out by
        ``layout.second``. Padded: ``[B, L]`` tensors, right-padded ``attention_mask``, ``task_ids [B]``
        (optional for one task), ``*_b [B, L2]``; packed here once (:meth:`batch_layout`, one host read)."""
        if deprecated:
            layout = self._deprecated_layout(
                deprecated, layout, input_ids, attention_mask, task_ids, input_ids_b
            )
        if layout is None:
            if input_ids.dim() != 2:
                raise ValueError(
                    f"input_ids must be [B, L] with attention_mask, or [N] with the batch's layout, got shape "
                    f"{list(input_ids.shape)}"
                )
            mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            layout = self.batch_layout(mask, task_ids, attention_mask_b)
        if input_ids.dim() == 2:  # padded: to packed rows, once, here
            input_ids, token_type_ids = _packed_rows(layout, None, input_ids, token_type_ids)
            if layout.second is not None and input_ids_b is not None:
                rows = torch.as_tensor(layout.second_rows, device=input_ids_b.device)
                input_ids_b, token_type_ids_b = _packed_rows(
                    layout.second, rows, input_ids_b, token_type_ids_b
                )
        num, max_pos = len(self.tasks), self.config.bert.max_position_embeddings
        if layout.host_task_ids is None or layout.num_tasks != num:
            raise ValueError(f"the batch's layout must hold task ids of this model's {num} tasks")
        if layout.max_seqlen > max_pos:
            raise ValueError(
                f"a sequence of {layout.max_seqlen} tokens is longer than max_position_embeddings {max_pos}: "
                f"encode with max_length <= {max_pos} (train: --max-length)"
            )
        enc_tasks = layout.task_ids if self.bert.num_tasks else None
        out_a = self.bert(input_ids, None, token_type_ids, enc_tasks, layout=layout)
        tokens = list(layout.task_tokens)
        second, out_b = layout.second, None
        if any(self.tasks[t].siamese for t in layout.present):
            if input_ids_b is None or second is None:
                raise ValueError("siamese tasks need input_ids_b and cu_seqlens_b (their second sentences)")
            expected = sum(n for t, n in enumerate(layout.task_examples) if self.tasks[t].siamese)
            if second.batch != expected:
                raise ValueError(f"cu_seqlens_b holds {second.batch} sequences for {expected} siamese rows")
            out_b = self.bert(input_ids_b, None, token_type_ids_b, enc_tasks, layout=second)
            tokens = [n + second.task_tokens[t] for t, n in enumerate(tokens)]
        logits = self._head_logits(layout, out_a, out_b)
        return MultiTaskOutput(
            logits, layout.task_ids, out_a.pooler_output, layout=layout, task_tokens=tokens
        )

    def _head_logits(self, layout: BatchLayout, out_a: Any, out_b: Any | None) -> Tensor:
        """fp32 logits ``[B, max num_labels]``: each present task's head on its rows' features of the encoder
        outputs ``out_a`` (and ``out_b``, the siamese second sentences: cosine, or the head on ``(u, v, |u - v|)``)."""
        width, pieces, pooled = max(t.num_labels for t in self.tasks), [], out_a.pooler_output
        # fp32 logits: in bf16 a cosine near 1 has only 3 digits
        logits = None if layout.grouped else pooled.new_zeros(layout.batch, width, dtype=torch.float32)
        for i in layout.present:
            spec, rows = self.tasks[i], layout.rows_of(i)
            u = take_rows(self._features(spec, out_a), rows)
            if spec.siamese:
                grouped = isinstance(rows, slice)
                rows_b = slice(*layout.second.example_ranges[i]) if grouped else layout.second_slot[rows]
                v = take_rows(self._features(spec, out_b), rows_b)
                if spec.pair_mode == "sbert_cosine":
                    y = F.cosine_similarity(u.float(), v.float(), dim=-1)[:, None]
                else:
                    y = self.heads[spec.name](torch.cat([u, v, (u - v).abs()], dim=-1))
            else:
                y = self.heads[spec.name](u)
            y = F.pad(y, (0, width - y.shape[1]))
            if logits is None:
                pieces.append(y.float())
            else:
                logits = logits.index_copy(0, rows, y.to(logits.dtype))
        if logits is None:
            logits = torch.cat(pieces) if pieces else pooled.new_zeros(0, width, dtype=torch.float32)
        return logits

    def _siamese_rows(self, layout: BatchLayout) -> np.ndarray:
        """The rows of ``layout`` whose task is siamese (host indices)."""
        return np.flatnonzero([self.tasks[t].siamese for t in layout.host_task_ids])

    def batch_layout(
        self, attention_mask: Tensor, task_ids: Tensor | None = None, attention_mask_b: Tensor | None = None
    ) -> BatchLayout:
        """The layout :meth:`forward` runs a padded batch as: ``attention_mask [B, L]`` right-padded,
        ``task_ids [B]`` int64 (None for one task), ``attention_mask_b [B, L2]`` (siamese rows). One host read."""
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask must be [B, L], got shape {list(attention_mask.shape)}")
        task_ids = self._task_ids(task_ids, attention_mask.shape[0], attention_mask.device)
        layout = BatchLayout.from_mask(attention_mask, task_ids, len(self.tasks))
        rows = self._siamese_rows(layout)
        if rows.size:
            if attention_mask_b is None:
                raise ValueError("siamese pair tasks need input_ids_b and attention_mask_b")
            mask_b = attention_mask_b.index_select(0, torch.as_tensor(rows, device=attention_mask_b.device))
            layout.with_second(
                BatchLayout.from_mask(mask_b, layout.host_task_ids[rows], len(self.tasks)), rows
            )
        return layout

    def _deprecated_layout(
        self, kwargs: dict[str, Any], layout: BatchLayout | None, *tensors: Tensor | None
    ) -> BatchLayout | None:
        """The layout of the former keywords (``unpad``, ``cu_seqlens``, ``max_seqlen``, ``*_b``), with a
        FutureWarning; ``tensors``: ``input_ids, attention_mask, task_ids, input_ids_b``."""
        if unknown := set(kwargs) - {"unpad", "cu_seqlens", "max_seqlen", "cu_seqlens_b", "max_seqlen_b"}:
            raise TypeError(f"MultiTaskBert.forward() got unexpected keyword arguments {sorted(unknown)}")
        warnings.warn(
            f"MultiTaskBert.forward: {', '.join(sorted(kwargs))} will be removed in the next release: padded "
            "inputs always run packed; pass packed tensors with their layout (model_inputs(batch, device))",
            FutureWarning,
            stacklevel=5,
        )
        cu_seqlens = kwargs.get("cu_seqlens")
        if cu_seqlens is None or layout is not None:
            return layout
        input_ids, attention_mask, task_ids, input_ids_b = tensors
        if attention_mask is not None:
            raise ValueError("packed inputs (cu_seqlens given) take no attention_mask")
        sizes = len(self.tasks), self.config.bert.max_position_embeddings
        task_ids = self._task_ids(task_ids, cu_seqlens.shape[0] - 1, input_ids.device)
        layout = layout_from_cu_seqlens(input_ids, cu_seqlens, kwargs.get("max_seqlen"), task_ids, *sizes)
        rows, cu_b = self._siamese_rows(layout), kwargs.get("cu_seqlens_b")
        if rows.size and input_ids_b is not None and cu_b is not None:
            if cu_b.shape[0] - 1 != rows.size:
                raise ValueError(
                    f"cu_seqlens_b holds {cu_b.shape[0] - 1} sequences for {rows.size} siamese rows"
                )
            ids_b = layout.task_ids.index_select(0, torch.as_tensor(rows, device=input_ids.device))
            second = layout_from_cu_seqlens(input_ids_b, cu_b, kwargs.get("max_seqlen_b"), ids_b, *sizes)
            layout.with_second(second, rows)
        return layout

    def _task_ids(self, task_ids: Tensor | None, b: int, device: torch.device) -> Tensor:
        """``task_ids`` checked as long ``[B]`` (the layout checks the range), or zeros for a one-task model."""
        if task_ids is None:
            if len(self.tasks) != 1:
                raise ValueError("task_ids is required for a model with more than one task")
            task_ids = torch.zeros(b, dtype=torch.long, device=device)
        return check_task_ids(task_ids, len(self.tasks), b, device, check_values=False)

    def task_losses(self, output: MultiTaskOutput, labels: Tensor, weighting: str = "examples") -> TaskLosses:
        """:func:`fastpals.model.heads.task_losses` of this model's tasks; labels ``[B]`` float."""
        return task_losses(self.tasks, output, labels, weighting)

    def loss(self, output: MultiTaskOutput, labels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The sum of each present task's mean loss, and those losses; labels ``[B]`` float."""
        return summed_loss(self.tasks, output, labels)

    def predict(self, output: MultiTaskOutput) -> Tensor:
        """Predicted labels ``[B]`` float32 (:func:`fastpals.model.heads.predict`); no host reads."""
        return predict(self.tasks, output)

    def adapter_state_dict(self) -> dict[str, Tensor]:
        """The task-specific weights (PALs and heads) by their names in this model."""
        return {k: v for k, v in self.state_dict().items() if task_specific_kind(k) is not None}

    def trained_base_state_dict(self) -> dict[str, Tensor]:
        """The shared parameters that train while others are frozen (the freeze LayerNorms); else empty."""
        shared = {n: p for n, p in self.named_parameters() if task_specific_kind(n) is None}
        if all(p.requires_grad for p in shared.values()):
            return {}
        return {n: p.detach() for n, p in shared.items() if p.requires_grad}

    @property
    def encoder_prefix(self) -> str:
        """Where the encoder's HF-named modules sit: ``"bert"`` (minBERT) or ``"bert.model"`` (HF encoder)."""
        return "bert" if isinstance(self.bert, BertModel) else "bert.model"

    def save_pretrained(
        self, folder: str | os.PathLike, adapters_only: bool = False, tokenizer: Any | None = None
    ) -> Path:
        """Save for :meth:`from_pretrained` and HF tools; returns the folder. Full: ``config.json``,
        ``model.safetensors``, ``pals/adapter_*``, tokenizer files; ``adapters_only``: ``adapter_*``."""
        folder, cfg, n_layers = Path(folder), self.config, self.config.bert.num_hidden_layers
        folder.mkdir(parents=True, exist_ok=True)
        tensors = self.adapter_state_dict()
        heads = {k for k in tensors if task_specific_kind(k) == "head"}
        base = self.trained_base_state_dict() if adapters_only else {}
        if adapters_only:  # warn when a shared parameter the adapter does not carry changed since from_base
            start, inner = getattr(self, "base_digests", None), {n.removeprefix("bert.") for n in base}
            digests = parameter_digests(self.bert) if start else {}
            if changed := [n for n, d in digests.items() if n not in inner and start.get(n) != d]:
                warnings.warn(
                    f"save_pretrained(adapters_only=True): the shared encoder trained ({len(changed)} "
                    f"tensors changed, e.g. {changed[0]}) but is not saved, so the adapter will not load "
                    "beside its base encoder (encoder fingerprint): save the full model "
                    "(adapters_only=False) to keep the encoder",
                    UserWarning,
                    stacklevel=2,
                )
            adapter_dir = folder
        else:
            adapter_dir, prefix = folder / ADAPTER_SUBFOLDER, self.encoder_prefix + "."
            shared = {  # the shared encoder's weights under HF names (BertModel's, or the HF encoder's own)
                k.removeprefix(prefix): v.detach().contiguous().cpu()
                for k, v in self.state_dict().items()
                if k.startswith(prefix) and task_specific_kind(k) is None
            }
            if isinstance(self.bert, BertModel):
                dtype = str(shared["embeddings.word_embeddings.weight"].dtype).removeprefix("torch.")
                hf = dict(architectures=["BertModel"], model_type="bert", **dataclasses.asdict(cfg.bert))
                hf.update(position_embedding_type="absolute", initializer_range=0.02, use_cache=True)
                (folder / "config.json").write_text(json.dumps({**hf, "torch_dtype": dtype}, indent=2))
            else:
                self.bert.model.config.save_pretrained(folder)
            save_file(shared, str(folder / "model.safetensors"), metadata={"format": "pt"})
        model_type = cfg.extra.get("hf_model_type", "bert")
        target = TARGETS.get(model_type, TARGETS["bert"])
        encoder = {
            "prefix": self.encoder_prefix,
            "model_type": model_type,
            "layers_pattern": target.layers,
            "layer_norm_name": target.layer_norm,
            "hidden_size": cfg.bert.hidden_size,
            "num_layers": n_layers,
            "layer_indices": [] if cfg.pal is None else cfg.pal.layer_indices(n_layers),
            "fingerprint": encoder_fingerprint(self.bert, {n.removeprefix("bert.") for n in base}),
        }
        extra = {**cfg.extra, "head_dropout": cfg.head_dropout}
        if not adapters_only:  # the PALs belong to the encoder saved beside them
            extra["fine_tuned_from"] = cfg.base_model
        write_adapter(
            adapter_dir, {**tensors, **base}, head_names=heads, trained_base_names=set(base),
            pal_config=None if cfg.pal is None else cfg.pal.to_dict(), encoder=encoder,
            base_model_name_or_path=cfg.base_model if adapters_only else None, task_names=self.task_names,
            tasks=[t.to_dict() for t in self.tasks], modules_to_save=["heads"], extra=extra,
            saved_from=type(self).__name__,
        )  # fmt: skip
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        return folder

    def load_adapter(
        self,
        folder: str | os.PathLike,
        load_trained_base: bool = True,
        strict: bool = True,
        force: bool = False,
    ) -> MultiTaskBert:
        """Load an adapter of :meth:`save_pretrained` or :func:`fastpals.save_pals`; returns the model. PALs
        must match exactly; heads and trained base weights load by name (``strict``: a tensor with no place is
        an error, else a warning). Refused beside another encoder unless ``force``."""
        config, tensors, adapter = read_adapter(folder, "load_adapter")
        check_encoder_fingerprint(
            config.get("encoder", {}).get("fingerprint"), self.bert, trained_base_in_encoder(config),
            str(adapter), "load_adapter", force,
        )  # fmt: skip
        own = None if self.config.pal is None else self.config.pal.to_dict()
        saved = config.get("pal_config")
        if (own is None) != (saved is None):
            raise ValueError(
                f"load_adapter: {adapter} holds {'no PALs' if saved is None else 'PALs'} but this model has "
                f"{'none' if own is None else 'PALs'}"
            )
        if own is not None:
            check_same_pal_config(own, saved, str(adapter), "load_adapter")
        options = {"load_trained_base": load_trained_base, "strict": strict}
        load_adapter_tensors(
            self, self.encoder_prefix, config, tensors, source=str(adapter), caller="load_adapter", **options
        )
        return self


LEGACY_CONFIG_NAME = "fastpals_config.json"


def _load_exact(
    module: nn.Module, state: dict[str, Tensor], source: Path, task_specific: bool | None = None
) -> None:
    """Load exactly ``module``'s task-specific (True), shared (False) or all (None) weights of ``state``."""
    own = module.state_dict()
    if task_specific is not None:
        own = {k: v for k, v in own.items() if (task_specific_kind(k) is not None) == task_specific}
    problems = state_dict_mismatches(own, state)
    if problems:
        raise ValueError(f"cannot load {source}:\n  " + "\n  ".join(problems))
    module.load_state_dict(state, strict=task_specific is None)


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Parameter counts (each tied tensor once): ``total``, ``encoder``, ``pal`` (task-specific encoder
    parameters), ``heads``, and one per PAL category of the registered variants (:func:`pal_count_categories`)."""
    counts = dict.fromkeys(("total", "encoder", "pal", "heads", *pal_count_categories()), 0)
    for name, p in model.named_parameters():
        n, kind = p.numel(), task_specific_kind(name)
        counts["total"] += n
        counts[{"head": "heads", "pal": "pal", None: "encoder"}[kind]] += n
        if kind == "pal":
            category = pal_parameter_category(name)
            counts[category] = counts.get(category, 0) + n
    return counts


def _packed_rows(layout: BatchLayout, rows: Tensor | None, *padded: Tensor | None) -> list:
    """Padded ``[B, L]`` tensors (their ``rows`` only, when given; None stays None) → packed ``[N]`` rows."""
    picked = (t if t is None or rows is None else t.index_select(0, rows) for t in padded)
    return [None if t is None else layout.to_rows(t[:, : layout.max_seqlen]) for t in picked]
