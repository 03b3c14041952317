"""minBERT with Projected Attention Layers (Stickland & Murray 2019) under HF ``BertModel`` names, and the
reading of HF and CS224N checkpoints: ``h' = LN(attn_out + FFN(attn_out) + gate · TS_t(h))``, ``TS_t(h) =
act(V^D_t · MHA_{t,l}(V^E_t · h))`` (act: GELU by default), ``t`` each row's task. ``B`` batch, ``L`` padded
length, ``N`` packed tokens, ``d`` hidden size, ``T`` tasks, ``d_s`` PAL width."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from fastpals.data.hub import resolve_model_dir
from fastpals.data.layout import BatchLayout, layout_from_cu_seqlens, make_layout
from fastpals.encoder.pal_variants import (
    PAL_VARIANTS,
    PALLayer,
    PALProjections,
    PALTop,
    PALVariant,
    freeze_shared_parameters,
    get_pal_variant,
    is_task_specific,
    task_specific_kind,
)
from fastpals.functional import Dropout, check_task_ids, dropout_add
from fastpals_kernels.attention_varlen import attention_varlen, padded_attention
from fastpals_kernels.backends import backend
from fastpals_kernels.dropout_layer_norm import dropout_add_layer_norm

__all__ = [
    "BertConfig",
    "BertModel",
    "BertOutput",
    "LoadReport",
    "PALConfig",
    "freeze_shared_parameters",
    "is_ignorable_key",
    "load_bert_state_dict",
    "normalize_key",
    "state_dict_mismatches",
    "task_specific_kind",
]


def is_ignorable_key(name: str) -> bool:
    """Checkpoint entries that are not encoder weights: the position-id buffer and pre-training heads."""
    return name.endswith("position_ids") or name.startswith(("cls.", "lm_head.", "classifier."))


_MINBERT_NAMES = {  # CS224N minBERT → HF
    "word_embedding": "embeddings.word_embeddings",
    "pos_embedding": "embeddings.position_embeddings",
    "tk_type_embedding": "embeddings.token_type_embeddings",
    "embed_layer_norm": "embeddings.LayerNorm",
    "pooler_dense": "pooler.dense",
}
_MINBERT_LAYER_NAMES = {
    "self_attention.query": "attention.self.query",
    "self_attention.key": "attention.self.key",
    "self_attention.value": "attention.self.value",
    "attention_dense": "attention.output.dense",
    "attention_layer_norm": "attention.output.LayerNorm",
    "interm_dense": "intermediate.dense",
    "out_dense": "output.dense",
    "out_layer_norm": "output.LayerNorm",
}


def normalize_key(key: str) -> str:
    """A checkpoint key under HF ``BertModel``'s name (no ``bert.``; TF ``gamma``/``beta``, CS224N names)."""
    key = key.removeprefix("bert.")
    if key.endswith(".gamma"):
        key = key[:-6] + ".weight"
    elif key.endswith(".beta"):
        key = key[:-5] + ".bias"
    head, _, tail = key.partition(".")
    if head in _MINBERT_NAMES:
        return f"{_MINBERT_NAMES[head]}.{tail}"
    if head == "bert_layers":
        idx, _, rest = tail.partition(".")
        for old, new in _MINBERT_LAYER_NAMES.items():
            if rest.startswith(old + "."):
                return f"encoder.layer.{idx}.{new}{rest[len(old) :]}"
    return key


def state_dict_mismatches(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> list[str]:
    """Readable differences of a model's tensors (``expected``) and a checkpoint's (``found``)."""
    problems = [f"missing in checkpoint: {k}" for k in sorted(set(expected) - set(found))]
    problems += [f"not in the model: {k}" for k in sorted(set(found) - set(expected))]
    problems += [
        f"{k}: saved {list(v.shape)}, model {list(expected[k].shape)}"
        for k, v in found.items()
        if k in expected and v.shape != expected[k].shape
    ]
    return problems


@dataclass
class LoadReport:
    """What a checkpoint load did: ``loaded`` tensors, ``missing`` model keys, ``unexpected`` ones."""

    missing: list[str]
    unexpected: list[str]
    loaded: int

    def __str__(self) -> str:
        missing, unexpected = self.missing or "none", self.unexpected or "none"
        return f"loaded {self.loaded} tensors; missing {missing}; unexpected {unexpected}"


def load_bert_state_dict(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read ``model.safetensors`` (preferred) or ``pytorch_model.bin`` from a checkpoint folder."""
    folder = Path(folder)
    st, pt = folder / "model.safetensors", folder / "pytorch_model.bin"
    path = st if st.is_file() else pt if pt.is_file() else None
    if path is None:
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor pytorch_model.bin")
    try:
        return load_file(str(st)) if path is st else torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged or foreign file: name it (the loaders' errors do not)
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise OSError(
            f"{path} is not a readable weights file ({type(err).__name__}: {detail}): replace it (download "
            f"or copy the model again)"
        ) from err


@dataclass
class BertConfig:
    """The HF ``config.json`` fields minBERT uses (other fields are ignored)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BertConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        if cfg.hidden_act not in ("gelu", "gelu_new", "relu"):
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported (gelu, gelu_new, relu)")
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ValueError(
                f"hidden_size {cfg.hidden_size} is not divisible by num_attention_heads {cfg.num_attention_heads}"
            )
        return cfg

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> BertConfig:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


@dataclass
class PALConfig:
    """What PALs to add and where; the defaults are the original Bert-n-Pals code. ``hidden`` (d_s),
    ``num_heads``: the projected attention's width; ``gelu``: GELU after V^D; ``shared_projections``: one
    V^E/V^D pair per task for all layers, else one per layer; ``layers``: ``"all"``, the top k layers or a
    list of indices; ``gate``: a learned scalar on TS; ``variant``: a registered :class:`PALVariant`
    (``"parallel"``, ``"top"``: blocks after the last layer, ``"top_parallel"``: both, ``"embert"``: per-task
    vectors added to Q, K, V, ``"none"``); ``top_blocks``/``top_heads``: the top's depth and heads;
    ``dropout``: None = BERT's attention dropout; ``zero_init_decoder``: V^D starts at zero (the PAL adds 0 at
    the first update)."""

    num_tasks: int = 3
    hidden: int = 204
    num_heads: int = 6
    gelu: bool = True
    shared_projections: bool = True
    layers: str | int | list[int] = "all"
    gate: bool = False
    gate_init: float = 1.0
    variant: str = "parallel"
    top_blocks: int = 6
    top_heads: int = 12
    top_shares_projections: bool = False
    dropout: float | None = None
    init_std: float = 0.02
    zero_init_decoder: bool = False

    VARIANTS = PAL_VARIANTS.keys()  # the registered variants' names (a live view)

    @classmethod
    def half(cls, **kw: Any) -> PALConfig:
        """Bert-n-Pals' "half": PALs in the top 6 layers only, d_s = 276 (6 heads of 46)."""
        return cls(**{"layers": 6, "hidden": 276, "num_heads": 6, **kw})

    @property
    def pal_variant(self) -> PALVariant:
        """The registered :class:`PALVariant` named ``variant`` (``ValueError`` if none)."""
        return get_pal_variant(self.variant)

    def validate(self, num_layers: int) -> None:
        """Raise ``ValueError`` naming the first field that cannot build PALs for a ``num_layers``-layer model."""
        self.pal_variant.validate(self, num_layers)

    def layer_indices(self, num_layers: int) -> list[int]:
        """The encoder layers that carry a per-layer PAL (none unless the variant has them)."""
        return self.pal_variant.layer_indices(self, num_layers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PALConfig:
        if unknown := set(d) - {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"unknown PALConfig fields: {sorted(unknown)}")
        return cls(**d)


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.hidden_dropout_prob)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """int64 ``[B, L]`` → ``[B, L, d]``, or packed ``[N]`` with ``position_ids [N]`` → ``[N, d]``."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(x + self.token_type_embeddings(token_type_ids)))


class BertSelfAttention(nn.Module):
    """Q/K/V projections and attention; a PAL variant may change Q/K/V (:meth:`PALVariant.qkv`)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout_p = cfg.attention_probs_dropout_prob
        self.pal_variant: PALVariant | None = None

    def forward(self, x: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        q, k, v = self.query(x), self.key(x), self.value(x)
        if self.pal_variant is not None:
            q, k, v = self.pal_variant.qkv(self, q, k, v, layout)
        dropout = self.dropout_p if self.training else 0.0
        shape = (*q.shape[:-1], self.num_heads, self.head_dim)
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        if layout.packed:
            plan = layout.attention_plan() if layout.buckets else None
            ctx = attention_varlen(q, k, v, layout.cu_seqlens, layout.max_seqlen, dropout, plan)
        else:
            ctx = padded_attention(q, k, v, layout.padding_mask(), dropout)
        return ctx.flatten(-2)


class BertSelfOutput(nn.Module):
    """Dense, dropout, residual, LayerNorm; from ``d_in`` features (HF's ``BertSelfOutput`` and ``BertOutput``)."""

    def __init__(self, cfg: BertConfig, d_in: int | None = None) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in or cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.hidden_dropout_prob)

    def forward(self, ctx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.add_layer_norm(self.dense(ctx), x)

    def add(self, y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``dropout(y) + residual``, in one pass where the op library fuses it."""
        return dropout_add(y, residual, self.dropout.p, self.dropout.training)

    def add_layer_norm(self, y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``LayerNorm(dropout(y) + residual)``: one fused op on CUDA (:func:`fused_layer_norm`), else :meth:`add`
        then the LayerNorm module."""
        if not fused_layer_norm(y, self.LayerNorm):
            return self.LayerNorm(self.add(y, residual))
        norm, p = self.LayerNorm, self.dropout.p
        return dropout_add_layer_norm(y, residual, norm.weight, norm.bias, norm.eps, p, self.dropout.training)


def fused_layer_norm(y: torch.Tensor, norm: nn.LayerNorm) -> bool:
    """Does a sublayer's dropout + residual + LayerNorm run as the op library's fused op on ``y``: a CUDA tensor the
    dispatch sends to Triton, and ``norm`` a plain affine ``nn.LayerNorm`` call (no forward hooks, no replaced
    forward, as PAL injection and the per-task gradient capture set: the fused op would skip them)?"""
    plain = type(norm) is nn.LayerNorm and "forward" not in vars(norm) and norm.bias is not None
    hooked = norm._forward_hooks or norm._forward_pre_hooks
    return y.is_cuda and plain and not hooked and backend("dropout_layer_norm", y) == "triton"


class BertLayer(nn.Module):
    """Post-LN transformer layer; a PAL variant may change what enters the final LayerNorm and what leaves."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = nn.Module()  # HF's names: attention.self, attention.output, intermediate.dense
        self.attention.self = BertSelfAttention(cfg)
        self.attention.output = BertSelfOutput(cfg)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        acts = {"gelu": nn.GELU, "gelu_new": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU}
        self.intermediate.act = acts[cfg.hidden_act]()
        self.output = BertSelfOutput(cfg, cfg.intermediate_size)
        self.pal: PALLayer | None = None
        self.pal_variant: PALVariant | None = None

    def forward(self, x: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """x: [B, L, d] or packed [N, d] → same shape."""
        attn = self.attention.output(self.attention.self(x, layout), x)
        ffn = self.intermediate.act(self.intermediate.dense(attn))
        if self.pal_variant is None:
            return self.output.add_layer_norm(self.output.dense(ffn), attn)
        pre_ln = self.output.add(self.output.dense(ffn), attn)
        pre_ln = self.pal_variant.pre_layer_norm(self, x, layout, pre_ln)
        return self.pal_variant.layer_output(self, self.output.LayerNorm(pre_ln), layout)


@dataclass
class BertOutput:
    """``last_hidden_state [B, L, d]`` (packed: ``[N, d]``, ``cu_seqlens [B+1]`` int32), ``pooler_output``."""

    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor
    cu_seqlens: torch.Tensor | None = None


class BertModel(nn.Module):
    """BERT encoder with optional PALs. ``BertModel(config, pal=PALConfig(...))`` or ``from_pretrained``."""

    def __init__(self, config: BertConfig, pal: PALConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.pal_config = pal
        self.embeddings = BertEmbeddings(config)
        self.encoder = nn.Module()  # HF's names: encoder.layer.<i>
        self.encoder.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.pooler = nn.Module()  # tanh(dense(first token))
        self.pooler.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.apply(self._init_bert_weights)
        self.pal_projections: PALProjections | None = None
        self.pal_top: PALTop | None = None
        if pal is not None:
            self.add_pals(pal)
        self.load_report: LoadReport | None = None
        self.activation_checkpointing = False

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each encoder layer in the backward (training with gradients on); results are unchanged."""
        self.activation_checkpointing = bool(enabled)

    def _init_bert_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def add_pals(self, pal: PALConfig) -> None:
        """Add fresh PALs of ``pal`` in place to a model that has none, and hand the variant to the layers."""
        if any(is_task_specific(n) for n, _ in self.named_parameters()):
            raise ValueError("add_pals: this model already has task-specific (PAL) parameters")
        pal.validate(self.config.num_hidden_layers)
        variant = pal.pal_variant
        variant.add_parameters(self, pal)
        for layer in self.encoder.layer:
            layer.pal_variant = layer.attention.self.pal_variant = variant
        self.pal_config = pal

    @property
    def pal_variant(self) -> PALVariant | None:
        """The :class:`PALVariant` of ``pal_config`` (None without PALs)."""
        return None if self.pal_config is None else self.pal_config.pal_variant

    @property
    def task_specific(self) -> bool:
        """True when the encoder has task-specific parameters (its forward then needs task ids)."""
        return self.pal_config is not None and self.pal_config.pal_variant.task_specific

    @property
    def num_tasks(self) -> int:
        return 0 if self.pal_config is None else self.pal_config.num_tasks

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        task_ids: torch.Tensor | None = None,
        unpad: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        layout: BatchLayout | None = None,
    ) -> BertOutput:
        """Padded int64 ``[B, L]`` inputs (``unpad``: run packed inside), or packed ``[N]`` ones with their
        ``layout`` or ``cu_seqlens [B+1]`` int32 and ``max_seqlen``; ``task_ids [B]`` if task-specific."""
        packed = cu_seqlens is not None or (layout is not None and input_ids.dim() == 1)
        max_pos = self.config.max_position_embeddings
        if packed and attention_mask is not None:
            raise ValueError("packed inputs (cu_seqlens given) take no attention_mask")
        if not packed and input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {list(input_ids.shape)}")
        if not packed and input_ids.shape[1] > max_pos:
            raise ValueError(
                f"sequence length {input_ids.shape[1]} > max_position_embeddings {max_pos}: encode with "
                f"max_length <= {max_pos} (train: --max-length)"
            )
        if not packed and attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        token_type_ids = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        for name, t in (("token_type_ids", token_type_ids), ("attention_mask", attention_mask)):
            if t is not None and t.shape != input_ids.shape:
                raise ValueError(f"{name} shape {list(t.shape)} != input_ids {list(input_ids.shape)}")
        task_ids = task_ids if self.task_specific else None
        if packed and layout is None:
            layout = layout_from_cu_seqlens(
                input_ids, cu_seqlens, max_seqlen, task_ids, self.num_tasks, max_pos
            )
        elif layout is None:
            b = input_ids.shape[0]
            if task_ids is not None:
                task_ids = check_task_ids(task_ids, self.num_tasks, b, input_ids.device, check_values=False)
            layout = make_layout(attention_mask, task_ids, unpad, tuple(input_ids.shape), self.num_tasks)
        elif packed and input_ids.shape[0] != layout.total:
            raise ValueError(f"packed input_ids must be [N] = [{layout.total}] (the layout's tokens)")
        elif not packed and ((layout.batch, layout.length) != input_ids.shape or layout.packed != unpad):
            raise ValueError(f"the layout ({layout.batch} x {layout.length}) does not describe this batch")
        if self.task_specific and layout.task_ids is None:
            raise ValueError("this model has task-specific PAL parameters: pass task_ids (one per sequence)")
        x = self.embeddings(input_ids, token_type_ids, layout.position_ids if packed else None)
        x = x if packed else layout.to_rows(x)
        checkpointed = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.encoder.layer:
            x = checkpoint(layer, x, layout, use_reentrant=False) if checkpointed else layer(x, layout)
        if self.pal_variant is not None:
            x = self.pal_variant.encoder_output(self, x, layout)
        hidden = x if packed else layout.to_padded(x)
        first = x.index_select(0, layout.cls_index) if packed else hidden[:, 0]
        return BertOutput(hidden, torch.tanh(self.pooler.dense(first)), layout.cu_seqlens if packed else None)

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | os.PathLike, pal: PALConfig | None = None, strict: bool = True
    ) -> BertModel:
        """Load ``minilm-l6``, a folder of an HF BERT checkpoint, or a Hub name, in eval mode, PALs fresh.
        Unknown and missing keys go to ``load_report`` and a warning; ``strict``: missing ones are an error."""
        weights = ("model.safetensors", "pytorch_model.bin")
        folder = resolve_model_dir(name_or_path, ("config.json",), any_of=weights)
        model = cls(BertConfig.from_json(folder / "config.json"), pal=pal)
        model.load_report = model.load_bert_weights(load_bert_state_dict(folder), strict, str(folder))
        return model.eval()

    def load_bert_weights(
        self, state: dict[str, torch.Tensor], strict: bool = True, source: str = ""
    ) -> LoadReport:
        """Copy encoder weights from an HF/CS224N state dict (names normalised by :func:`normalize_key`)."""
        own = {k: v for k, v in self.state_dict().items() if not is_task_specific(k)}
        renamed = {normalize_key(key): (key, value) for key, value in state.items()}
        normalized = {new: value for new, (_, value) in renamed.items() if new in own}
        unexpected = sorted(
            key for new, (key, _) in renamed.items() if new not in own and not is_ignorable_key(new)
        )
        missing = sorted(set(own) - set(normalized))
        mismatched = state_dict_mismatches({k: own[k] for k in normalized}, normalized)
        if mismatched:
            raise ValueError(f"shape mismatch loading {source}:\n  " + "\n  ".join(mismatched))
        report = LoadReport(missing, unexpected, len(normalized))
        if missing and strict:
            raise ValueError(
                f"checkpoint {source} lacks encoder weights: {missing[:10]}{' ...' if len(missing) > 10 else ''}"
            )
        self.load_state_dict(normalized, strict=False)
        if report.missing or report.unexpected:
            warnings.warn(f"loading {source}: {report}", stacklevel=3)
        return report
