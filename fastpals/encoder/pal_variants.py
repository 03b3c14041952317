"""PAL variants: one stateless :class:`PALVariant` subclass per ``PALConfig.variant``, registered in
:data:`PAL_VARIANTS`. Hidden states are the layout's rows, ``[B, L, d]`` or packed ``[N, d]``; ``T`` tasks."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastpals.data.layout import BatchLayout
from fastpals.functional import PALWeights, attention_reference, grouped_linear_reference, segment_linear
from fastpals_kernels.attention_varlen import attention_varlen
from fastpals_kernels.pal import PackedSegments, run_pal

if TYPE_CHECKING:
    from fastpals.encoder.bert import BertConfig, BertLayer, BertModel, BertSelfAttention, PALConfig


# parameter names below are part of the checkpoint format
def _normal(shape: tuple[int, ...], std: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(shape) * std)


class PALProjections(nn.Module):
    """V^E (d → d_s) and V^D (d_s → d) for every task: ``enc_weight [T, d_s, d]``, ``enc_bias [T, d_s]``,
    ``dec_weight [T, d, d_s]``, ``dec_bias [T, d]``."""

    def __init__(self, num_tasks: int, d: int, d_s: int, std: float, zero_decoder: bool) -> None:
        super().__init__()
        self.enc_weight = _normal((num_tasks, d_s, d), std)
        self.enc_bias = nn.Parameter(torch.zeros(num_tasks, d_s))
        shape = (num_tasks, d, d_s)
        self.dec_weight = nn.Parameter(torch.zeros(shape)) if zero_decoder else _normal(shape, std)
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
        self.projections = None if shared else PALProjections(t, d, d_s, pal.init_std, pal.zero_init_decoder)
        object.__setattr__(self, "_shared", shared)  # owned by the model: not a submodule

    def weights(self) -> PALWeights:
        """This PAL's weights and options for one op call (dropout 0.0 in eval mode)."""
        p = self.projections or self._shared
        return PALWeights(
            p.enc_weight, p.enc_bias, self.qkv_weight, self.qkv_bias, p.dec_weight, p.dec_bias,
            self.num_heads, self.gelu, self.dropout_p if self.training else 0.0,
        )  # fmt: skip

    def forward(self, h: Tensor, layout: BatchLayout, residual: Tensor) -> Tensor:
        """h, residual: [B, L, d] or packed [N, d] → residual + gate · TS(h), same shape."""
        weights = self.weights()
        where = {"mask": None if layout.packed else layout.mask, "cu_seqlens": layout.cu_seqlens if layout.packed else None,
                 "max_seqlen": layout.max_seqlen}  # fmt: skip
        if layout.packed and layout.buckets:  # host facts that let the reference skip padded PAL work
            segments = layout.task_segments(weights.num_tasks)
            where["segments"] = PackedSegments(layout.row_task_ids, segments, layout.attention_plan())
        args = weights.as_args(layout.task_ids)
        if self.gate is None:
            return run_pal(h, args, **where, residual=residual)
        ts = run_pal(h, args, **where)
        ts = ts * layout.per_row(self.gate.index_select(0, layout.task_ids)).unsqueeze(-1).to(ts.dtype)
        return residual + ts


class PALTop(nn.Module):
    """Per task: V^E, ``top_blocks`` attention blocks, V^D; replaces the last layer's output (Bert-n-Pals'
    top)."""

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

    def forward(self, h: Tensor, layout: BatchLayout) -> Tensor:
        """h: the last layer's rows, ``[B, L, d]`` or ``[N, d]`` → the same shape."""
        p = self.projections or self._shared
        dropout = self.dropout_p if self.training else 0.0
        packed = h.dim() == 2  # packed rows: per-task GEMMs on task segments
        task_of_row = layout.row_task_ids if packed else layout.task_ids
        segments = layout.task_segments(self.qkv_weight.shape[1]) if packed else None
        plan = layout.attention_plan() if packed and layout.buckets else None

        def linear(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
            if segments is not None:
                return segment_linear(x, segments, w, b)
            return grouped_linear_reference(x, task_of_row, w, b)

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if packed:
                return attention_varlen(q, k, v, layout.cu_seqlens, layout.max_seqlen, dropout, plan)
            return attention_reference(q, k, v, layout.padding_mask(), dropout)

        def per_row(t: Tensor) -> Tensor:
            t = t.index_select(0, task_of_row)
            return t if packed else t[:, None]

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


@dataclass(frozen=True)
class PALPreset:
    """A ``--pal`` preset: the ``PALConfig`` fields it sets (None: no PALs), its ``--help`` text, its rank."""

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
    """One PAL variant. ``name``: its ``PALConfig.variant``; ``task_specific``: the forward needs task ids;
    ``injectable``: :func:`fastpals.inject_pals` supports it; ``module_names`` / ``parameter_names``: its
    parameters' names; ``count_categories``: its :func:`fastpals.count_parameters` keys; ``presets``: its
    ``--pal`` presets."""

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
    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> PALVariant:
        return self

    __copy__ = __deepcopy__

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return get_pal_variant, (self.name,)

    @property
    def supports_peft(self) -> bool:
        """The PEFT method ``FASTPALS`` supports exactly the :attr:`injectable` variants."""
        return self.injectable

    def validate(self, pal: PALConfig, num_layers: int) -> None:
        """Raise ``ValueError`` naming the first field of ``pal`` that cannot build for ``num_layers`` layers."""
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
        """The sorted indices of the layers that carry a per-layer PAL; none by default."""
        return []

    def cli_check(self, pal: PALConfig, preset: str) -> str | None:
        """A one-line problem of the config the trainer built from ``--pal preset`` (and ``--pal-*``), or None."""
        return None

    def add_parameters(self, model: BertModel, pal: PALConfig) -> None:
        """Add fresh task-specific parameters of the validated ``pal`` to ``model`` in place."""

    def parameter_category(self, name: str) -> str | None:
        """The count category of parameter ``name`` when it is this variant's, else None."""
        if self.count_categories and _owns(name, self.module_names, self.parameter_names):
            return self.count_categories[0]
        return None

    def qkv(
        self, attention: BertSelfAttention, q: Tensor, k: Tensor, v: Tensor, layout: BatchLayout
    ) -> tuple[Tensor, Tensor, Tensor]:
        """A layer's ``q, k, v`` rows → the ``q, k, v`` its attention uses."""
        return q, k, v

    def pre_layer_norm(self, layer: BertLayer, h: Tensor, layout: BatchLayout, pre_ln: Tensor) -> Tensor:
        """What enters ``layer``'s final LayerNorm, from ``pre_ln = attn_out + FFN(attn_out)`` and input ``h``."""
        return pre_ln

    def layer_output(self, layer: BertLayer, out: Tensor, layout: BatchLayout) -> Tensor:
        """``layer``'s output rows → the next layer's input."""
        return out

    def encoder_output(self, model: BertModel, x: Tensor, layout: BatchLayout) -> Tensor:
        """The last layer's output (``[N, d]`` or ``[B, L, d]``) → ``last_hidden_state``."""
        return x


class Parallel(PALVariant):
    """Bert-n-Pals' PALs in ``PALConfig.layers``: ``LN(attn_out + FFN(attn_out) + gate · TS_t(h))``."""

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
        cfg, dropout = model.config, pal_dropout(pal, model.config)
        layers = self.layer_indices(pal, cfg.num_hidden_layers)
        if layers and pal.shared_projections:
            model.pal_projections = PALProjections(
                pal.num_tasks, cfg.hidden_size, pal.hidden, pal.init_std, pal.zero_init_decoder
            )
        for i in layers:
            model.encoder.layer[i].pal = PALLayer(pal, cfg.hidden_size, dropout, model.pal_projections)

    def parameter_category(self, name: str) -> str | None:
        if not _owns(name, Parallel.module_names, ()):
            return None
        if name.endswith(".gate"):
            return "pal_gates"
        if "qkv_" in name:
            return "pal_attention"
        return "pal_projections"

    def pre_layer_norm(self, layer: BertLayer, h: Tensor, layout: BatchLayout, pre_ln: Tensor) -> Tensor:
        """``pre_ln + gate · TS_t(h)`` in the layers with a PAL."""
        if layer.pal is None:
            return pre_ln
        return layer.pal(h, layout, residual=pre_ln)


class Top(PALVariant):
    """:class:`PALTop` blocks after the last layer, replacing the encoder's output."""

    name = "top"
    module_names = ("pal_top",)
    count_categories = ("pal_top",)
    presets = MappingProxyType({"top": PALPreset({"variant": "top"}, rank=50)})

    def check(self, pal: PALConfig, num_layers: int) -> None:
        if pal.hidden % pal.top_heads:
            raise ValueError(f"PALConfig.top_heads={pal.top_heads} must divide PALConfig.hidden={pal.hidden}")

    def cli_check(self, pal: PALConfig, preset: str) -> str | None:
        if pal.hidden % pal.top_heads:
            return f"--pal {preset}: its {pal.top_heads} top heads do not divide d_s = {pal.hidden}"
        return None

    def add_parameters(self, model: BertModel, pal: PALConfig) -> None:
        cfg = model.config
        share = model.pal_projections if pal.top_shares_projections else None
        if pal.top_shares_projections and share is None:
            raise ValueError("top_shares_projections needs variant='top_parallel' with shared_projections")
        model.pal_top = PALTop(pal, cfg.hidden_size, cfg.layer_norm_eps, pal_dropout(pal, cfg), share)

    def parameter_category(self, name: str) -> str | None:
        return "pal_top" if _owns(name, Top.module_names, ()) else None

    def encoder_output(self, model: BertModel, x: Tensor, layout: BatchLayout) -> Tensor:
        return x if model.pal_top is None else model.pal_top(x, layout)


class TopParallel(Parallel, Top):
    """:class:`Parallel` in the layers and :class:`Top` after them (``top_shares_projections``: one V^E/V^D)."""

    name = "top_parallel"
    injectable = False
    module_names = Parallel.module_names + Top.module_names
    count_categories = Parallel.count_categories + Top.count_categories
    presets = MappingProxyType({"top_parallel": PALPreset({"variant": "top_parallel"}, rank=60)})

    def check(self, pal: PALConfig, num_layers: int) -> None:
        Top.check(self, pal, num_layers)
        Parallel.check(self, pal, num_layers)

    def add_parameters(self, model: BertModel, pal: PALConfig) -> None:
        Parallel.add_parameters(self, model, pal)
        Top.add_parameters(self, model, pal)

    def parameter_category(self, name: str) -> str | None:
        return Top.parameter_category(self, name) or Parallel.parameter_category(self, name)


class EmBERT(PALVariant):
    """Per-task vectors ``task_embedding [T, 3, d]`` (zeros at first) added to every layer's Q, K and V."""

    name = "embert"
    parameter_names = ("task_embedding",)
    count_categories = ("embert",)
    presets = MappingProxyType({"embert": PALPreset({"variant": "embert"}, rank=80)})

    def add_parameters(self, model: BertModel, pal: PALConfig) -> None:
        shape = (pal.num_tasks, 3, model.config.hidden_size)
        for layer in model.encoder.layer:
            layer.attention.self.task_embedding = nn.Parameter(torch.zeros(shape))

    def qkv(
        self, attention: BertSelfAttention, q: Tensor, k: Tensor, v: Tensor, layout: BatchLayout
    ) -> tuple[Tensor, Tensor, Tensor]:
        emb = getattr(attention, "task_embedding", None)
        if emb is None:
            return q, k, v
        vec = layout.per_row(emb.index_select(0, layout.task_ids))  # [B,1,3,d] or [N,3,d]
        return q + vec[..., 0, :], k + vec[..., 1, :], v + vec[..., 2, :]


class NoPAL(PALVariant):
    """The multi-task baseline: no task-specific encoder parameters, only the heads."""

    name = "none"
    task_specific = False
    presets = MappingProxyType({"none": PALPreset(None, "multi-task baseline", rank=0)})


#: every registered variant by ``PALConfig.variant``, in registration order
PAL_VARIANTS: dict[str, PALVariant] = {}
_BUILTIN = ("parallel", "top", "top_parallel", "embert", "none")


def register_pal_variant(
    variant: PALVariant | type[PALVariant], *, replace: bool = False
) -> PALVariant | type[PALVariant]:
    """Register a variant (instance or class) under its name, its parameter names task-specific;
    returns ``variant`` (a class decorator). ``replace``: replace a registered non-built-in one."""
    obj = variant() if isinstance(variant, type) else variant
    if not isinstance(obj, PALVariant):
        raise TypeError(f"register_pal_variant: expected a PALVariant, got {type(obj).__name__}")
    name = obj.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_pal_variant: {type(obj).__name__}.name must be a non-empty string")
    if name in PAL_VARIANTS and (not replace or name in _BUILTIN):
        raise ValueError(f"register_pal_variant: a PAL variant named {name!r} is already registered")
    if isinstance(obj.module_names, str) or isinstance(obj.parameter_names, str):
        raise TypeError("register_pal_variant: module_names and parameter_names are name tuples, not strings")
    PAL_VARIANTS[name] = obj
    return variant


def unregister_pal_variant(name: str) -> None:
    """Remove a variant registered with :func:`register_pal_variant` (not a built-in one) and its names."""
    if name in _BUILTIN:
        raise ValueError(f"unregister_pal_variant: {name!r} is a built-in PAL variant")
    if name not in PAL_VARIANTS:
        raise KeyError(f"unregister_pal_variant: no PAL variant named {name!r}")
    del PAL_VARIANTS[name]


def get_pal_variant(name: str) -> PALVariant:
    """The registered variant called ``name``; ``ValueError`` listing the registered names otherwise."""
    if name not in PAL_VARIANTS:
        raise ValueError(f"PALConfig.variant={name!r}: choose one of {', '.join(PAL_VARIANTS)}")
    return PAL_VARIANTS[name]


def pal_presets() -> dict[str, PALPreset]:
    """Every registered variant's ``--pal`` presets by rank, then registration order (first of a name wins)."""
    found: dict[str, PALPreset] = {}
    for variant in PAL_VARIANTS.values():
        for preset, spec in variant.presets.items():
            found.setdefault(preset, spec)
    return dict(sorted(found.items(), key=lambda kv: kv[1].rank))  # stable: registration order among equals


def pal_count_categories() -> tuple[str, ...]:
    """The PAL count categories of every registered variant, each once, in registration order."""
    return tuple(dict.fromkeys(c for v in PAL_VARIANTS.values() for c in v.count_categories))


def pal_parameter_category(name: str) -> str:
    """The count category of PAL parameter ``name`` from the first variant that claims it, else ``"pal_other"``."""
    categories = (variant.parameter_category(name) for variant in PAL_VARIANTS.values())
    return next((category for category in categories if category is not None), "pal_other")


def task_specific_kind(name: str) -> str | None:
    """``"pal"`` (a registered variant's weights), ``"head"`` (under a module ``heads``) or None (shared) for
    a parameter name, matched by whole dotted parts under any prefix: the rule every part of fastpals uses."""
    parts = name.split(".")
    if "heads" in parts[:-1]:
        return "head"
    if any(_owns(name, v.module_names, v.parameter_names) for v in PAL_VARIANTS.values()):
        return "pal"
    return None


def is_task_specific(name: str) -> bool:
    """True for task-specific parameter names (PALs, task heads; :func:`task_specific_kind`), else False."""
    return task_specific_kind(name) is not None


def freeze_shared_parameters(
    model: nn.Module, train_layer_norms: bool = True, modules_to_train: Iterable[str] = ()
) -> dict[str, int]:
    """The Bert-n-Pals "freeze" recipe: freeze every parameter but the task-specific ones, the LayerNorms
    (with ``train_layer_norms``) and the modules ``modules_to_train`` names (by qualified-name suffix; one
    matching nothing is an error). Returns ``{"trainable": n, "frozen": m}`` element counts."""
    if isinstance(modules_to_train, str):
        raise TypeError("modules_to_train must be a list of module names, not a string")
    names = list(modules_to_train)
    unmatched = set(names)
    keep = {id(p) for n, p in model.named_parameters() if is_task_specific(n)}
    for name, module in model.named_modules():
        hit = [t for t in names if name == t or name.endswith("." + t)]
        unmatched -= set(hit)
        # LayerNorms by module type (any library's class named *LayerNorm), never by parameter name
        layer_norm = isinstance(module, nn.LayerNorm) or type(module).__name__.lower().endswith("layernorm")
        if hit or (train_layer_norms and layer_norm):
            keep.update(id(p) for p in module.parameters())
    if unmatched:
        raise ValueError(f"freeze_shared_parameters: modules_to_train {sorted(unmatched)} match no module")
    counts = {"trainable": 0, "frozen": 0}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
        counts["trainable" if id(p) in keep else "frozen"] += p.numel()
    return counts


for _cls in (Parallel, Top, TopParallel, EmBERT, NoPAL):
    register_pal_variant(_cls)
del _cls
