"""Where :func:`fastpals.inject_pals` puts the PALs (:data:`TARGETS` by ``config.model_type``, checked by
:func:`resolve_targets`). ``TS_t(h)`` joins the layer's last residual sum: the final LayerNorm's input of
post-LN layers (``site="norm_input"``), or ``mlp``'s output in pre-LN ModernBERT (``site="output"``)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from fastpals.encoder.bert import BertModel as MiniBert
from fastpals.encoder.bert import PALConfig
from fastpals.encoder.pal_variants import PAL_VARIANTS

__all__ = ["TARGETS", "PALTarget", "ResolvedTargets", "builds_own_pals", "is_known_model", "resolve_targets"]


@dataclass(frozen=True)
class PALTarget:
    """Where the PALs go in one architecture: ``layers``, the end of the layer list's path (its parent is the
    base model); ``layer_norm``, a layer's final LayerNorm (with ``site="output"``: the module whose output
    takes ``TS_t(h)``); ``dropout_attr``, the config attribute of the attention dropout (the PAL's
    default)."""

    layers: str
    layer_norm: str
    dropout_attr: str = "attention_probs_dropout_prob"
    site: str = "norm_input"


_BERT_LIKE = PALTarget("encoder.layer", "output.LayerNorm")

#: Known architectures, by ``config.model_type``. Others: pass ``layers_pattern`` and ``layer_norm_name``.
TARGETS: dict[str, PALTarget] = {
    "bert": _BERT_LIKE,
    "roberta": _BERT_LIKE,
    "xlm-roberta": _BERT_LIKE,
    "electra": _BERT_LIKE,
    "distilbert": PALTarget("transformer.layer", "output_layer_norm", "attention_dropout"),
    "deberta-v2": _BERT_LIKE,  # DeBERTa-v2 and v3 (v3 checkpoints have model_type "deberta-v2")
    "modernbert": PALTarget("layers", "mlp", "attention_dropout", site="output"),
}


@dataclass
class ResolvedTargets:
    """The resolved targets of one model (nothing changed yet)."""

    kind: str  # "hf" (hooks) or "minbert" (minBERT's own PAL path)
    model_type: str | None
    base_name: str  # the base model's name in the root ("" = the root itself)
    base: nn.Module
    layers_pattern: str  # the layer list's path relative to the base
    layer_norm_name: str
    site: str  # "norm_input" or "output" (PALTarget.site)
    layers: list[nn.Module]
    layer_norms: list[nn.Module]
    hidden_size: int
    dropout: float
    mask_position: int | None  # index of attention_mask among the base forward's positional parameters


def builds_own_pals(model: nn.Module) -> bool:
    """Does ``model`` build, save and load its PALs itself (:class:`fastpals.MultiTaskBert`)? Read from the
    class mark ``builds_own_pals``, not by importing the model layer above this one."""
    return bool(getattr(type(model), "builds_own_pals", False))


def resolve_targets(
    model: nn.Module,
    config: PALConfig,
    layers_pattern: str | None,
    layer_norm_name: str | None,
    mask_argument: str,
) -> ResolvedTargets:
    """The targets of ``model`` for ``config`` (``layers_pattern`` / ``layer_norm_name``: None = by model type;
    ``mask_argument``: the base forward's ``[B, L]`` padding-mask argument). Raises ``TypeError`` /
    ``ValueError`` naming what is wrong or not found; changes nothing."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"inject_pals: model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(config, PALConfig):
        raise TypeError(f"inject_pals: config must be a fastpals.PALConfig, got {type(config).__name__}")
    variant = PAL_VARIANTS.get(config.variant)
    if variant is None or not variant.injectable:
        supported = ", ".join(repr(name) for name, v in PAL_VARIANTS.items() if v.injectable)
        raise ValueError(
            f"inject_pals: PALConfig.variant={config.variant!r} is not supported by injection (only {supported}); "
            "build fastpals.BertModel(config, pal=...) for the other variants"
        )
    minis = [(name, m) for name, m in model.named_modules() if isinstance(m, MiniBert)]
    if minis:
        return _resolve_minbert(model, config, minis, layers_pattern, layer_norm_name)
    hf_config = getattr(model, "config", None)
    model_type = getattr(hf_config, "model_type", None)
    target = TARGETS.get(model_type)
    lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if target is None and (layers_pattern is None or layer_norm_name is None):
        given = {"layers_pattern": layers_pattern, "layer_norm_name": layer_norm_name}
        missing = " and ".join(a for a, v in given.items() if v is None)
        raise ValueError(
            f"inject_pals: no PAL targets known for {type(model).__name__} (model_type={model_type!r}; known: "
            f"{', '.join(sorted(TARGETS))}, fastpals.BertModel): pass {missing}. "
            f"Module lists in this model: {lists or 'none'}"
        )
    layers_pattern = target.layers if layers_pattern is None else layers_pattern
    # the site goes with the target's module: a layer_norm_name of the caller's is a LayerNorm's input
    own_site = target is not None and layer_norm_name in (None, target.layer_norm)
    site = target.site if own_site else "norm_input"
    layer_norm_name = target.layer_norm if layer_norm_name is None else layer_norm_name
    found = [n for n in lists if n == layers_pattern or n.endswith("." + layers_pattern)]
    if not found:
        raise ValueError(
            f"inject_pals: no nn.ModuleList named '{layers_pattern}' (layers_pattern) found in "
            f"{type(model).__name__}; module lists in this model: {lists or 'none'}"
        )
    if len(found) > 1:
        raise ValueError(
            f"inject_pals: layers_pattern '{layers_pattern}' matches {len(found)} module lists ({found}): "
            "give a longer pattern"
        )
    full = found[0]
    base_name = full[: -len(layers_pattern)].rstrip(".")
    base = model.get_submodule(base_name) if base_name else model
    layers = list(base.get_submodule(layers_pattern))
    if not layers:
        raise ValueError(f"inject_pals: the layer list '{full}' is empty")
    norms = []
    for i, layer in enumerate(layers):
        try:
            norms.append(layer.get_submodule(layer_norm_name))
        except AttributeError:
            children = [n for n, _ in layer.named_modules() if n]
            raise ValueError(
                f"inject_pals: layer {full}.{i} ({type(layer).__name__}) has no module '{layer_norm_name}' "
                f"(layer_norm_name); its modules: {children}"
            ) from None
    hidden = _hidden_size(hf_config, norms[0], layer_norm_name)
    config.validate(len(layers))
    dropout = config.dropout
    if dropout is None:
        attrs = [target.dropout_attr] if target is not None else []
        attrs += ["attention_probs_dropout_prob", "attention_dropout"]
        values = [
            getattr(hf_config, a) for a in attrs if isinstance(getattr(hf_config, a, None), (int, float))
        ]
        if not values:
            raise ValueError(
                f"inject_pals: {type(model).__name__} has no config attribute {attrs[0]!r} giving the attention "
                "dropout: set PALConfig.dropout"
            )
        dropout = float(values[0])
    if getattr(hf_config, "chunk_size_feed_forward", 0):
        raise ValueError(
            "inject_pals: config.chunk_size_feed_forward > 0 runs the final LayerNorm on sequence chunks; "
            "set it to 0 to inject PALs"
        )
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    params = [p for p in inspect.signature(base.forward).parameters.values() if p.kind not in variadic]
    names = [p.name for p in params]
    if mask_argument not in names:
        raise ValueError(
            f"inject_pals: the base model {type(base).__name__}.forward has no '{mask_argument}' argument "
            f"(mask_argument); its arguments: {names}"
        )
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return ResolvedTargets(
        kind="hf",
        model_type=model_type,
        base_name=base_name,
        base=base,
        layers_pattern=layers_pattern,
        layer_norm_name=layer_norm_name,
        site=site,
        layers=layers,
        layer_norms=norms,
        hidden_size=hidden,
        dropout=dropout,
        mask_position=positional.index(mask_argument) if mask_argument in positional else None,
    )


def _resolve_minbert(
    model: nn.Module,
    config: PALConfig,
    minis: list[tuple[str, nn.Module]],
    layers_pattern: str | None,
    layer_norm_name: str | None,
) -> ResolvedTargets:
    if builds_own_pals(model):
        raise TypeError(
            "inject_pals: fastpals.MultiTaskBert builds its PALs itself: pass pal=PALConfig(...) to "
            "MultiTaskBert.from_pretrained / MultiTaskConfig instead"
        )
    if len(minis) > 1:
        raise ValueError(
            f"inject_pals: {type(model).__name__} holds {len(minis)} fastpals.BertModel modules "
            f"({', '.join(n or '<root>' for n, _ in minis)}): inject into one of them"
        )
    for arg, value, default in (
        ("layers_pattern", layers_pattern, "encoder.layer"),
        ("layer_norm_name", layer_norm_name, "output.LayerNorm"),
    ):
        if value not in (None, default):
            raise ValueError(
                f"inject_pals: {arg}={value!r} does not apply to fastpals.BertModel ({default!r})"
            )
    name, mini = minis[0]
    if mini.task_specific:
        raise ValueError(f"inject_pals: the fastpals.BertModel at {name or '<root>'} already has PALs")
    config.validate(mini.config.num_hidden_layers)
    layers = list(mini.encoder.layer)
    return ResolvedTargets(
        kind="minbert",
        model_type="fastpals-bert",
        base_name=name,
        base=mini,
        layers_pattern="encoder.layer",
        layer_norm_name="output.LayerNorm",
        site="norm_input",
        layers=layers,
        layer_norms=[layer.output.LayerNorm for layer in layers],
        hidden_size=mini.config.hidden_size,
        dropout=mini.config.attention_probs_dropout_prob if config.dropout is None else config.dropout,
        mask_position=None,
    )


def _hidden_size(cfg: object, norm: nn.Module, layer_norm_name: str) -> int:
    shape = getattr(norm, "normalized_shape", None)
    if isinstance(shape, (tuple, list)) and len(shape) == 1:
        return int(shape[0])
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        return int(weight.shape[0])
    for attr in ("hidden_size", "dim", "d_model"):
        if isinstance(getattr(cfg, attr, None), int):
            return int(getattr(cfg, attr))
    raise ValueError(
        f"inject_pals: cannot tell the hidden size: '{layer_norm_name}' ({type(norm).__name__}) has no "
        "normalized_shape or 1-D weight, and the model config has no hidden_size"
    )


def is_known_model(model: nn.Module) -> bool:
    """Does ``model`` have targets without ``layers_pattern`` / ``layer_norm_name`` (a known ``model_type``, or
    a fastpals ``BertModel`` inside)?"""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in TARGETS or any(isinstance(m, MiniBert) for m in model.modules())
