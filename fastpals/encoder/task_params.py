"""Which parameters are task-specific: the one rule the trainer, surgery, freezing, saving and injection use."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

#: the module names of the built-in PAL variants' weights (:mod:`fastpals.encoder.pal_variants`)
PAL_MODULE_NAMES = ("pal", "pal_projections", "pal_top")
HEAD_MODULE_NAME = "heads"
#: EmBERT's per-layer parameter (``attention.self.task_embedding``)
TASK_EMBEDDING_NAME = "task_embedding"

# names registered by PAL variants (fastpals.encoder.pal_variants.register_pal_variant), by owner (the variant's name)
_REGISTERED: dict[str, tuple[frozenset[str], frozenset[str]]] = {}


def register_task_specific_names(
    owner: str, modules: Iterable[str] = (), parameters: Iterable[str] = ()
) -> None:
    """Make parameter names task-specific (kind ``"pal"``): under a module named one of ``modules``, or whose
    last part is one of ``parameters``; ``owner`` replaces what it registered before."""
    if isinstance(modules, str) or isinstance(parameters, str):
        raise TypeError("register_task_specific_names: modules and parameters are name lists, not strings")
    _REGISTERED[owner] = (frozenset(modules), frozenset(parameters))


def unregister_task_specific_names(owner: str) -> None:
    """Forget the names ``owner`` registered with :func:`register_task_specific_names` (none: no-op)."""
    _REGISTERED.pop(owner, None)


def task_specific_kind(name: str) -> str | None:
    """``"pal"`` (any variant's PAL weights), ``"head"`` (under a module named ``heads``) or None (shared) for a
    parameter name, matched by whole dotted parts under any prefix."""
    parts = name.split(".")
    if HEAD_MODULE_NAME in parts[:-1]:
        return "head"
    modules = set(PAL_MODULE_NAMES).union(*(m for m, _ in _REGISTERED.values()))
    parameters = {TASK_EMBEDDING_NAME}.union(*(p for _, p in _REGISTERED.values()))
    if any(p in modules for p in parts[:-1]) or parts[-1] in parameters:
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
    """The Bert-n-Pals "freeze" recipe: freeze every parameter but the task-specific ones, the LayerNorms (with
    ``train_layer_norms``) and the modules ``modules_to_train`` names (by qualified-name suffix; one matching
    nothing is an error). Returns ``{"trainable": n, "frozen": m}`` element counts."""
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
        raise ValueError(f"freeze_shared_parameters: modules_to_train {sorted(unmatched)} match no module")
    counts = {"trainable": 0, "frozen": 0}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
        counts["trainable" if id(p) in keep else "frozen"] += p.numel()
    return counts
