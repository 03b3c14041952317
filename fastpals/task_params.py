"""Which parameters are task-specific: the one rule the trainer, surgery, freezing, saving and injection use."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = [
    "HEAD_MODULE_NAME",
    "PAL_MODULE_NAMES",
    "TASK_EMBEDDING_NAME",
    "freeze_shared_parameters",
    "is_layer_norm",
    "is_task_specific",
    "task_specific_kind",
]

PAL_MODULE_NAMES = ("pal", "pal_projections", "pal_top")
HEAD_MODULE_NAME = "heads"
TASK_EMBEDDING_NAME = "task_embedding"


def task_specific_kind(name: str) -> str | None:
    """What a parameter (or state-dict) name holds: ``"pal"`` for PAL weights of every variant (a module named
    ``pal``, ``pal_projections`` or ``pal_top`` anywhere in the dotted name) and EmBERT's ``task_embedding``,
    ``"head"`` for task heads (a module named ``heads`` anywhere in the name, as in
    :class:`fastpals.MultiTaskBert` and ``inject_pals`` users' wrappers), ``None`` for shared (encoder) weights.
    Names are matched by whole dotted components, under any prefix."""
    parts = name.split(".")
    if HEAD_MODULE_NAME in parts[:-1]:
        return "head"
    if any(p in PAL_MODULE_NAMES for p in parts[:-1]) or parts[-1] == TASK_EMBEDDING_NAME:
        return "pal"
    return None


def is_task_specific(name: str) -> bool:
    """True for task-specific parameter names (PALs, task embeddings, task heads; see :func:`task_specific_kind`),
    False for the shared encoder weights. This is the rule every part of fastpals uses."""
    return task_specific_kind(name) is not None


def is_layer_norm(module: nn.Module) -> bool:
    """True for ``nn.LayerNorm`` and for LayerNorm classes of other libraries (class name ending in LayerNorm,
    e.g. apex's ``FusedLayerNorm``, T5's ``T5LayerNorm``): matched by module type, never by parameter name."""
    return isinstance(module, nn.LayerNorm) or type(module).__name__.lower().endswith("layernorm")


def freeze_shared_parameters(
    model: nn.Module, train_layer_norms: bool = True, modules_to_train: Iterable[str] = ()
) -> dict[str, int]:
    """The Bert-n-Pals "freeze" recipe: set ``requires_grad=False`` on every parameter of ``model`` except the
    task-specific ones (:func:`is_task_specific`), the LayerNorms (:func:`is_layer_norm`, when
    ``train_layer_norms``) and the modules named in ``modules_to_train``.

    ``modules_to_train``: module names, each matching a module whose qualified name equals it or ends with
    ``"." + name`` (e.g. ``"classifier"``, ``"pooler"``); a name that matches nothing is an error.
    Returns ``{"trainable": n, "frozen": m}`` parameter element counts.
    """
    if isinstance(modules_to_train, str):
        raise TypeError("modules_to_train must be a list of module names, not a string")
    names = list(modules_to_train)
    keep = {id(p) for n, p in model.named_parameters() if is_task_specific(n)}
    unmatched = set(names)
    for name, module in model.named_modules():
        hit = [t for t in names if name == t or name.endswith("." + t)]
        unmatched -= set(hit)
        if hit or (train_layer_norms and is_layer_norm(module)):
            keep.update(id(p) for p in module.parameters())
    if unmatched:
        raise ValueError(
            f"freeze_shared_parameters: modules_to_train names {sorted(unmatched)} match no module"
        )
    counts = {"trainable": 0, "frozen": 0}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
        counts["trainable" if id(p) in keep else "frozen"] += p.numel()
    return counts
