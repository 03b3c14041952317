"""PAL variants: one class per variant, holding everything about it.

``PALConfig.variant`` (a string, as saved in configs and adapter files and given on the command line) names a
:class:`PALVariant` in the registry :data:`PAL_VARIANTS`; ``PALConfig.pal_variant`` returns that object. A variant
says, for a :class:`~fastpals.encoder.bert.PALConfig` and a :class:`~fastpals.encoder.bert.BertModel`:

- which ``PALConfig`` fields it checks (:meth:`PALVariant.validate`) and which layers get a per-layer PAL
  (:meth:`PALVariant.layer_indices`);
- how its task-specific parameters are added to the model (:meth:`PALVariant.add_parameters`) and which names
  they have (:attr:`PALVariant.module_names` / :attr:`PALVariant.parameter_names`: the task-specific rule of
  :mod:`fastpals.encoder.task_params`, hence freezing, surgery, saving and loading) and their
  :func:`fastpals.count_parameters` categories (:meth:`PALVariant.parameter_category`);
- how it changes the forward, through four hooks the model calls with the module they change (identity by
  default): :meth:`~PALVariant.qkv` (a layer's self-attention Q/K/V), :meth:`~PALVariant.pre_layer_norm` (what
  enters a layer's final LayerNorm), :meth:`~PALVariant.layer_output` (a layer's output) and
  :meth:`~PALVariant.encoder_output` (the last layer's output);
- whether :func:`fastpals.inject_pals` (and so the PEFT method ``FASTPALS``) can add it to HF encoders
  (:attr:`PALVariant.injectable`), and its ``--pal`` presets of the trainer (:attr:`PALVariant.presets`).

The built-in variants are :class:`Parallel` (``"parallel"``, Bert-n-Pals' PALs inside the layers),
:class:`Top` (``"top"``), :class:`TopParallel` (``"top_parallel"``), :class:`EmBERT` (``"embert"``) and
:class:`NoPAL` (``"none"``). A new variant is one subclass registered with :func:`register_pal_variant`; nothing
else in fastpals changes. Variants hold no state: every method takes the config, model or module it works on.

Shapes: ``B`` batch, ``L`` padded length, ``N`` packed tokens, ``d`` hidden size, ``T`` tasks, ``d_s`` PAL width.
A layer's hidden states are "rows" of its :class:`~fastpals.data.layout.BatchLayout`: ``[B, L, d]`` (padded layouts)
or ``[N, d]`` (packed ones); ``layout.per_row(x)`` broadcasts a per-sequence ``x [B, ...]`` over them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fastpals.data.layout import BatchLayout
from fastpals.encoder.task_params import register_task_specific_names, unregister_task_specific_names
from fastpals.functional import (
    PALWeights,
    attention_reference,
    grouped_linear_reference,
    segment_linear,
)
from fastpals_kernels.attention_varlen import attention_varlen
from fastpals_kernels.pal import PackedSegments, run_pal

if TYPE_CHECKING:
    from fastpals.encoder.bert import BertConfig, BertLayer, BertModel, BertSelfAttention, PALConfig

__all__ = [
    "PAL_VARIANTS",
    "EmBERT",
    "NoPAL",
    "PALLayer",
    "PALPreset",
    "PALProjections",
    "PALTop",
    "PALVariant",
    "Parallel",
    "Top",
    "TopParallel",
    "get_pal_variant",
    "pal_count_categories",
    "pal_dropout",
    "pal_parameter_category",
    "pal_presets",
    "register_pal_variant",
    "unregister_pal_variant",
]


# ----------------------------------------------------------------------------------------------------------------
# The PAL modules (parameter names are part of the checkpoint format: keep them)
# ----------------------------------------------------------------------------------------------------------------
def _normal(shape: tuple[int, ...], std: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(shape) * std)


class PALProjections(nn.Module):
    """V^E (d → d_s) and V^D (d_s → d) for every task: ``enc_weight [T, d_s, d]``, ``enc_bias [T, d_s]``,
    ``dec_weight [T, d, d_s]``, ``dec_bias [T, d]``."""

    def __init__(self, num_tasks: int, d: int, d_s: int, std: float, zero_decoder: bool) -> None:
        super().__init__()
        self.enc_weight = _normal((num_tasks, d_s, d), std)
        self.enc_bias = nn.Parameter(torch.zeros(num_tasks, d_s))
        self.dec_weight = (
            nn.Parameter(torch.zeros(num_tasks, d, d_s))
            if zero_decoder
            else _normal((num_tasks, d, d_s), std)
        )
        self.dec_bias = nn.Parameter(torch.zeros(num_tasks, d))


class PALLayer(nn.Module):
    """The per-layer part of a PAL: per-task Q/K/V of the projected attention (``qkv_weight [T, 3 d_s, d_s]``,
    ``qkv_bias [T, 3 d_s]``), an optional gate ``[T]``, and the layer's own projections if not shared."""

    def __init__(self, pal: PALConfig, d: int, dropout: float, shared: PALProjections | None) -> None:
        super().__init__()
        t, d_s = pal.num_tasks, pal.hidden
        self.num_heads = pal.num_heads
        self.gelu = pal.gelu
        self.dropout_p = dropout
        self.qkv_weight = _normal((t, 3 * d_s, d_s), pal.init_std)
        self.qkv_bias = nn.Parameter(torch.zeros(t, 3 * d_s))
        self.gate = nn.Parameter(torch.full((t,), float(pal.gate_init))) if pal.gate else None
        self.projections = (
            PALProjections(t, d, d_s, pal.init_std, pal.zero_init_decoder) if shared is None else None
        )
        # The shared projections are owned by the model; keep a plain reference (not a submodule).
        object.__setattr__(self, "_shared", shared)

    def proj(self) -> PALProjections:
        """V^E/V^D of this layer: its own, or the model's shared ones."""
        return self.projections if self.projections is not None else self._shared

    def weights(self) -> PALWeights:
        """This PAL's weights and options for one op call (dropout 0.0 in eval mode)."""
        p = self.proj()
        return PALWeights(
            p.enc_weight, p.enc_bias, self.qkv_weight, self.qkv_bias, p.dec_weight, p.dec_bias,
            self.num_heads, self.gelu, self.dropout_p if self.training else 0.0,
        )  # fmt: skip

    def forward(self, h: torch.Tensor, layout: BatchLayout, residual: torch.Tensor) -> torch.Tensor:
        """h, residual: [B, L, d] or packed [N, d] → residual + gate · TS(h), same shape."""
        weights = self.weights()
        where = {"mask": None if layout.packed else layout.mask, "cu_seqlens": layout.cu_seqlens if layout.packed else None,
                 "max_seqlen": layout.max_seqlen}  # fmt: skip
        if layout.packed and layout.buckets:  # host facts that let the reference skip padded PAL work
            segments = PackedSegments(
                layout.row_task_ids, layout.task_segments(weights.num_tasks), layout.attention_plan()
            )
            where["segments"] = segments
        args = weights.as_args(layout.task_ids)
        if self.gate is None:
            return run_pal(h, args, **where, residual=residual)
        ts = run_pal(h, args, **where)
        ts = ts * layout.per_row(self.gate.index_select(0, layout.task_ids)).unsqueeze(-1).to(ts.dtype)
        return residual + ts


class PALTop(nn.Module):
    """Task-specific projected attention blocks after the last layer (Bert-n-Pals' ``top``): per task,
    V^E, then ``top_blocks`` attention blocks (Q/K/V, a d_s×d_s output dense, residual and LayerNorm, all per
    task), then V^D; the result replaces the last layer's output."""

    def __init__(
        self, pal: PALConfig, d: int, eps: float, dropout: float, shared: PALProjections | None
    ) -> None:
        super().__init__()
        t, d_s, n = pal.num_tasks, pal.hidden, pal.top_blocks
        self.num_heads = pal.top_heads
        self.dropout_p = dropout
        self.eps = eps
        self.qkv_weight = _normal((n, t, 3 * d_s, d_s), pal.init_std)
        self.qkv_bias = nn.Parameter(torch.zeros(n, t, 3 * d_s))
        self.out_weight = _normal((n, t, d_s, d_s), pal.init_std)
        self.out_bias = nn.Parameter(torch.zeros(n, t, d_s))
        self.ln_weight = nn.Parameter(torch.ones(n, t, d_s))
        self.ln_bias = nn.Parameter(torch.zeros(n, t, d_s))
        self.projections = PALProjections(t, d, d_s, pal.init_std, False) if shared is None else None
        object.__setattr__(self, "_shared", shared)

    def forward(self, h: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """h: the last layer's rows, ``[B, L, d]`` (padded layout) or ``[N, d]`` (packed) → the same shape."""
        p = self.projections if self.projections is not None else self._shared
        dropout = self.dropout_p if self.training else 0.0
        if h.dim() == 2:  # packed rows: varlen attention, per-task GEMMs on task segments
            segments = layout.task_segments(self.qkv_weight.shape[1])
            plan = layout.attention_plan() if layout.buckets else None

            def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                if segments is not None:
                    return segment_linear(x, segments, w, b)
                return grouped_linear_reference(x, layout.row_task_ids, w, b)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return attention_varlen(q, k, v, layout.cu_seqlens, layout.max_seqlen, dropout, plan)

            def per_row(t: torch.Tensor) -> torch.Tensor:
                return t.index_select(0, layout.row_task_ids)
        else:

            def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                return grouped_linear_reference(x, layout.task_ids, w, b)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return attention_reference(q, k, v, layout.padding_mask(), dropout)

            def per_row(t: torch.Tensor) -> torch.Tensor:
                return t.index_select(0, layout.task_ids)[:, None]

        x = linear(h, p.enc_weight, p.enc_bias)
        d_s = x.shape[-1]
        for i in range(self.qkv_weight.shape[0]):
            qkv = linear(x, self.qkv_weight[i], self.qkv_bias[i])
            q, k, v = qkv.view(*x.shape[:-1], 3, self.num_heads, d_s // self.num_heads).unbind(-3)
            y = linear(attend(q, k, v).reshape(x.shape), self.out_weight[i], self.out_bias[i]) + x
            y = F.layer_norm(y, (d_s,), eps=self.eps)
            x = y * per_row(self.ln_weight[i]) + per_row(self.ln_bias[i])
        return linear(x, p.dec_weight, p.dec_bias)


def pal_dropout(pal: PALConfig, config: BertConfig) -> float:
    """The attention-probability dropout inside PALs: ``pal.dropout``, or BERT's attention dropout when None."""
    return config.attention_probs_dropout_prob if pal.dropout is None else pal.dropout


# ----------------------------------------------------------------------------------------------------------------
# The variant interface
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PALPreset:
    """A ``--pal`` preset of the trainer (:mod:`fastpals.train.args`): the :class:`~fastpals.encoder.bert.PALConfig`
    fields it sets (``None``: no PALs at all, ``pal=None``), a short ``help`` for ``--help`` (may be empty), and
    its ``rank`` (presets are listed by rank, then in registration order)."""

    fields: Mapping[str, Any] | None
    help: str = ""
    rank: int = 1000

    def __post_init__(self) -> None:
        if self.fields is not None:
            object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))


def _owns(name: str, modules: tuple[str, ...], parameters: tuple[str, ...]) -> bool:
    parts = name.split(".")
    return any(p in modules for p in parts[:-1]) or parts[-1] in parameters


class PALVariant:
    """One PAL variant (subclass it, set :attr:`name`, register an instance with :func:`register_pal_variant`).

    Class attributes: :attr:`name` (the ``PALConfig.variant`` string), :attr:`task_specific` (it adds
    task-specific encoder parameters, so the encoder's forward needs task ids), :attr:`injectable`
    (:func:`fastpals.inject_pals` adds it to HF encoders; only :class:`Parallel`, whose HF hooks live in
    :mod:`fastpals.adapters.hooks`), :attr:`module_names` / :attr:`parameter_names` (its parameters' names: a module
    name anywhere in a dotted parameter name, or a parameter's own name; they become task-specific, see
    :func:`fastpals.encoder.bert.is_task_specific`), :attr:`count_categories` (its :func:`fastpals.count_parameters` keys)
    and :attr:`presets` (its ``--pal`` presets).
    """

    name: ClassVar[str] = ""
    task_specific: ClassVar[bool] = True
    injectable: ClassVar[bool] = False
    module_names: ClassVar[tuple[str, ...]] = ()
    parameter_names: ClassVar[tuple[str, ...]] = ()
    count_categories: ClassVar[tuple[str, ...]] = ()
    presets: ClassVar[Mapping[str, PALPreset]] = MappingProxyType({})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"

    # stateless: copies of a model share the registered object; a pickled model finds it again by name
    def __copy__(self) -> PALVariant:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> PALVariant:
        return self

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return get_pal_variant, (self.name,)

    @property
    def supports_peft(self) -> bool:
        """The PEFT method ``FASTPALS`` (:mod:`fastpals.adapters.peft_method`) adds PALs with :func:`fastpals.inject_pals`:
        it supports exactly the :attr:`injectable` variants."""
        return self.injectable

    # --- configuration ------------------------------------------------------------------------------------------
    def validate(self, pal: PALConfig, num_layers: int) -> None:
        """Raise ``ValueError`` naming the first field of ``pal`` this variant cannot build for a model of
        ``num_layers`` layers: the common fields (``num_tasks``, ``hidden``/``num_heads``), then this variant's
        (:meth:`check`), then ``dropout``."""
        if pal.num_tasks < 1:
            raise ValueError(f"PALConfig.num_tasks must be >= 1, got {pal.num_tasks}")
        if pal.hidden < 1 or pal.num_heads < 1 or pal.hidden % pal.num_heads:
            raise ValueError(f"PALConfig.num_heads={pal.num_heads} must divide PALConfig.hidden={pal.hidden}")
        self.check(pal, num_layers)
        if pal.dropout is not None and not 0.0 <= pal.dropout < 1.0:
            raise ValueError(f"PALConfig.dropout must be in [0, 1), got {pal.dropout}")

    def check(self, pal: PALConfig, num_layers: int) -> None:
        """This variant's own checks of ``pal`` (``ValueError``); none by default."""

    def layer_indices(self, pal: PALConfig, num_layers: int) -> list[int]:
        """The encoder layers (sorted indices in ``[0, num_layers)``) that carry a per-layer PAL
        (``BertLayer.pal``); none by default."""
        return []

    def cli_check(self, pal: PALConfig, preset: str) -> str | None:
        """A one-line problem of the config the trainer built from ``--pal preset`` (and ``--pal-*``), or None."""
        return None

    # --- parameters -----------------------------------------------------------------------------------------
    def add_parameters(self, model: BertModel, pal: PALConfig) -> None:
        """Add freshly initialised task-specific parameters of ``pal`` (validated) to ``model`` in place, named
        as :attr:`module_names` / :attr:`parameter_names` say. Creation order is the random-init order."""

    def parameter_category(self, name: str) -> str | None:
        """The :func:`fastpals.count_parameters` category of a task-specific parameter ``name`` when it is this
        variant's, else None. By default the first of :attr:`count_categories` for names matching
        :attr:`module_names` / :attr:`parameter_names`."""
        if self.count_categories and _owns(name, self.module_names, self.parameter_names):
            return self.count_categories[0]
        return None

    # --- forward hooks (identity by default) ----------------------------------------------------------------
    def qkv(
        self,
        attention: BertSelfAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BatchLayout,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's self-attention projections ``q, k, v`` (rows ``[B, L, d]`` or ``[N, d]``, the model's
        dtype) → the ``q, k, v`` the attention uses (same shapes)."""
        return q, k, v

    def pre_layer_norm(
        self, layer: BertLayer, h: torch.Tensor, layout: BatchLayout, pre_ln: torch.Tensor
    ) -> torch.Tensor:
        """What enters ``layer``'s final LayerNorm: ``pre_ln`` (``attn_out + FFN(attn_out)``, rows) changed
        given the layer input ``h`` (rows, same shape)."""
        return pre_ln

    def layer_output(self, layer: BertLayer, out: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """``layer``'s output ``out`` (after its final LayerNorm; rows) → the next layer's input (same shape)."""
        return out

    def encoder_output(self, model: BertModel, x: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """The last layer's output → the encoder's ``last_hidden_state`` (same shape): ``x`` is packed
        ``[N, d]`` when the model was given packed inputs (packed output), else padded ``[B, L, d]``."""
        return x


# ----------------------------------------------------------------------------------------------------------------
# The built-in variants
# ----------------------------------------------------------------------------------------------------------------
class Parallel(PALVariant):
    """Bert-n-Pals' PALs inside the layers: ``LN(attn_out + FFN(attn_out) + gate · TS_t(h))`` in the layers
    ``PALConfig.layers`` selects (``encoder.layer.{i}.pal``), V^E/V^D shared (``pal_projections``) or per layer.
    Count categories ``pal_projections`` (V^E/V^D), ``pal_attention`` (per-task Q/K/V), ``pal_gates``."""

    name = "parallel"
    injectable = True
    module_names = ("pal", "pal_projections")
    count_categories = ("pal_projections", "pal_attention", "pal_gates")
    presets = MappingProxyType({
        "default": PALPreset({}, "Bert-n-Pals: d_s 204, 6 heads, shared V^E/V^D", rank=10),
        "12heads": PALPreset({"num_heads": 12}, rank=20),
        "per_layer": PALPreset({"shared_projections": False}, "V^E/V^D per layer", rank=30),
        "half": PALPreset({"layers": 6, "hidden": 276, "num_heads": 6}, "top 6 layers, d_s 276", rank=40),
        "gate": PALPreset({"gate": True}, rank=70),
    })  # fmt: skip

    def check(self, pal: PALConfig, num_layers: int) -> None:
        """``layers`` must name layers of the model (see :meth:`layer_indices`)."""
        self.layer_indices(pal, num_layers)

    def layer_indices(self, pal: PALConfig, num_layers: int) -> list[int]:
        """``PALConfig.layers``: ``"all"``, an int k (the top k layers) or a list of distinct indices."""
        if pal.layers == "all":
            return list(range(num_layers))
        if isinstance(pal.layers, int) and not isinstance(pal.layers, bool):
            if not 1 <= pal.layers <= num_layers:
                raise ValueError(f"PALConfig.layers={pal.layers}: top k must be in [1, {num_layers}]")
            return list(range(num_layers - pal.layers, num_layers))
        if isinstance(pal.layers, (list, tuple)):
            bad = [i for i in pal.layers if not (isinstance(i, int) and 0 <= i < num_layers)]
            if bad or len(set(pal.layers)) != len(pal.layers) or not pal.layers:
                raise ValueError(f"PALConfig.layers={pal.layers}: need distinct indices in [0, {num_layers})")
            return sorted(pal.layers)
        raise ValueError(f"PALConfig.layers={pal.layers!r}: use 'all', an int (top k) or a list of indices")

    def add_parameters(self, model: BertModel, pal: PALConfig) -> None:
        """``model.pal_projections`` (when shared) and ``model.encoder.layer[i].pal`` for the PAL layers."""
        cfg = model.config
        layers = self.layer_indices(pal, cfg.num_hidden_layers)
        if layers and pal.shared_projections:
            model.pal_projections = PALProjections(
                pal.num_tasks, cfg.hidden_size, pal.hidden, pal.init_std, pal.zero_init_decoder
            )
        for i in layers:
            model.encoder.layer[i].pal = PALLayer(
                pal, cfg.hidden_size, pal_dropout(pal, cfg), model.pal_projections
            )

    def parameter_category(self, name: str) -> str | None:
        """``pal_gates`` (``.gate``), ``pal_attention`` (``qkv_*``) or ``pal_projections`` for names under
        ``pal`` / ``pal_projections``."""
        if not _owns(name, Parallel.module_names, ()):
            return None
        if name.endswith(".gate"):
            return "pal_gates"
        if "qkv_" in name:
            return "pal_attention"
        return "pal_projections"

    def pre_layer_norm(
        self, layer: BertLayer, h: torch.Tensor, layout: BatchLayout, pre_ln: torch.Tensor
    ) -> torch.Tensor:
        """``pre_ln + gate · TS_t(h)`` in the layers with a PAL (one fused op on CUDA)."""
        if layer.pal is None:
            return pre_ln
        return layer.pal(h, layout, residual=pre_ln)


class Top(PALVariant):
    """Task-specific projected attention blocks after the last layer (``pal_top``, :class:`PALTop`) whose output
    replaces the encoder's; ``top_blocks`` blocks of ``top_heads`` heads. Count category ``pal_top``."""

    name = "top"
    module_names = ("pal_top",)
    count_categories = ("pal_top",)
    presets = MappingProxyType({"top": PALPreset({"variant": "top"}, rank=50)})

    def check(self, pal: PALConfig, num_layers: int) -> None:
        """``top_heads`` must divide ``hidden``."""
        if pal.hidden % pal.top_heads:
            raise ValueError(f"PALConfig.top_heads={pal.top_heads} must divide PALConfig.hidden={pal.hidden}")

    def cli_check(self, pal: PALConfig, preset: str) -> str | None:
        """The top heads must divide the width the ``--pal-*`` options set."""
        if pal.hidden % pal.top_heads:
            return f"--pal {preset}: its {pal.top_heads} top heads do not divide d_s = {pal.hidden}"
        return None

    def add_parameters(self, model: BertModel, pal: PALConfig) -> None:
        """``model.pal_top``, with its own V^E/V^D, or the parallel PALs' shared ones
        (``top_shares_projections``, which needs them)."""
        cfg = model.config
        shared = model.pal_projections
        share = shared if (pal.top_shares_projections and shared) else None
        if pal.top_shares_projections and share is None:
            raise ValueError("top_shares_projections needs variant='top_parallel' with shared_projections")
        model.pal_top = PALTop(pal, cfg.hidden_size, cfg.layer_norm_eps, pal_dropout(pal, cfg), share)

    def parameter_category(self, name: str) -> str | None:
        """``pal_top`` for names under ``pal_top``."""
        return "pal_top" if _owns(name, Top.module_names, ()) else None

    def encoder_output(self, model: BertModel, x: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """The top blocks' output, in ``x``'s form (padded or packed)."""
        return x if model.pal_top is None else model.pal_top(x, layout)


class TopParallel(Parallel, Top):
    """Both :class:`Parallel` (in the layers) and :class:`Top` (after them); ``top_shares_projections`` makes the
    top reuse the parallel PALs' shared V^E/V^D. Forward hooks: Parallel's ``pre_layer_norm``, Top's
    ``encoder_output``."""

    name = "top_parallel"
    injectable = False
    module_names = Parallel.module_names + Top.module_names
    count_categories = Parallel.count_categories + Top.count_categories
    presets = MappingProxyType({"top_parallel": PALPreset({"variant": "top_parallel"}, rank=60)})

    def check(self, pal: PALConfig, num_layers: int) -> None:
        """Top's check (``top_heads``), then Parallel's (``layers``)."""
        Top.check(self, pal, num_layers)
        Parallel.check(self, pal, num_layers)

    def add_parameters(self, model: BertModel, pal: PALConfig) -> None:
        """Parallel's parameters, then Top's."""
        Parallel.add_parameters(self, model, pal)
        Top.add_parameters(self, model, pal)

    def parameter_category(self, name: str) -> str | None:
        """Top's category, else Parallel's."""
        return Top.parameter_category(self, name) or Parallel.parameter_category(self, name)


class EmBERT(PALVariant):
    """Per-task vectors added to Q, K and V of every BERT layer (``encoder.layer.{i}.attention.self.task_embedding``
    ``[T, 3, d]``, zero at the start). Count category ``embert``."""

    name = "embert"
    parameter_names = ("task_embedding",)
    count_categories = ("embert",)
    presets = MappingProxyType({"embert": PALPreset({"variant": "embert"}, rank=80)})

    def add_parameters(self, model: BertModel, pal: PALConfig) -> None:
        """``task_embedding [T, 3, d]`` (zeros) on every layer's self-attention."""
        for layer in model.encoder.layer:
            layer.attention.self.task_embedding = nn.Parameter(
                torch.zeros(pal.num_tasks, 3, model.config.hidden_size)
            )

    def qkv(
        self,
        attention: BertSelfAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: BatchLayout,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q + e_t[0]``, ``k + e_t[1]``, ``v + e_t[2]`` with each sequence's task vectors."""
        emb = getattr(attention, "task_embedding", None)
        if emb is None:
            return q, k, v
        vec = layout.per_row(emb.index_select(0, layout.task_ids))  # [B,1,3,d] or [N,3,d]
        return q + vec[..., 0, :], k + vec[..., 1, :], v + vec[..., 2, :]


class NoPAL(PALVariant):
    """No task-specific encoder parameters (the multi-task baseline: only the heads are per task). Its ``--pal``
    preset ``none`` builds no PALConfig at all."""

    name = "none"
    task_specific = False
    presets = MappingProxyType({"none": PALPreset(None, "multi-task baseline", rank=0)})


# ----------------------------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------------------------
#: every registered variant by name (``PALConfig.variant``), in registration order; change it with
#: :func:`register_pal_variant` / :func:`unregister_pal_variant` (they also register the parameter names)
PAL_VARIANTS: dict[str, PALVariant] = {}
_BUILTIN = ("parallel", "top", "top_parallel", "embert", "none")


def register_pal_variant(
    variant: PALVariant | type[PALVariant], *, replace: bool = False
) -> PALVariant | type[PALVariant]:
    """Register a variant (an instance, or a class, which is instantiated) under its :attr:`~PALVariant.name`,
    and make its parameter names task-specific. Returns ``variant`` (so it works as a class decorator).
    ``replace=True`` replaces a registered variant of the same name (the built-in ones cannot be replaced)."""
    obj = variant() if isinstance(variant, type) else variant
    if not isinstance(obj, PALVariant):
        raise TypeError(f"register_pal_variant: expected a PALVariant, got {type(obj).__name__}")
    name = obj.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_pal_variant: {type(obj).__name__}.name must be a non-empty string")
    if name in PAL_VARIANTS and (not replace or name in _BUILTIN):
        raise ValueError(f"register_pal_variant: a PAL variant named {name!r} is already registered")
    PAL_VARIANTS[name] = obj
    register_task_specific_names(name, obj.module_names, obj.parameter_names)
    return variant


def unregister_pal_variant(name: str) -> None:
    """Remove a variant registered with :func:`register_pal_variant` (not a built-in one) and its names."""
    if name in _BUILTIN:
        raise ValueError(f"unregister_pal_variant: {name!r} is a built-in PAL variant")
    if name not in PAL_VARIANTS:
        raise KeyError(f"unregister_pal_variant: no PAL variant named {name!r}")
    del PAL_VARIANTS[name]
    unregister_task_specific_names(name)


def get_pal_variant(name: str) -> PALVariant:
    """The registered variant called ``name``; ``ValueError`` listing the registered names otherwise."""
    variant = PAL_VARIANTS.get(name)
    if variant is None:
        raise ValueError(f"PALConfig.variant={name!r}: choose one of {', '.join(PAL_VARIANTS)}")
    return variant


def pal_presets() -> dict[str, PALPreset]:
    """Every registered variant's ``--pal`` presets, by rank then registration order (a name defined twice:
    the first one)."""
    found: dict[str, PALPreset] = {}
    for variant in PAL_VARIANTS.values():
        for preset, spec in variant.presets.items():
            found.setdefault(preset, spec)
    order = {name: i for i, name in enumerate(found)}
    return dict(sorted(found.items(), key=lambda kv: (kv[1].rank, order[kv[0]])))


def pal_count_categories() -> tuple[str, ...]:
    """The :func:`fastpals.count_parameters` PAL categories of every registered variant (each once, in
    registration order)."""
    return tuple(dict.fromkeys(c for v in PAL_VARIANTS.values() for c in v.count_categories))


def pal_parameter_category(name: str) -> str:
    """The count category of a task-specific PAL parameter ``name`` (kind ``"pal"``): the first registered
    variant's that claims it (``"pal_other"`` when none does)."""
    for variant in PAL_VARIANTS.values():
        category = variant.parameter_category(name)
        if category is not None:
            return category
    return "pal_other"


for _cls in (Parallel, Top, TopParallel, EmBERT, NoPAL):
    register_pal_variant(_cls)
del _cls
