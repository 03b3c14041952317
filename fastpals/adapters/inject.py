"""``inject_pals(model, PALConfig(...))``: PALs added in place to an HF encoder or minBERT, base parameter
names unchanged, through forward hooks (:class:`PALInjection`): the root and base models' take ``task_ids``
(or :func:`set_task`'s) and the padding mask, each layer's keeps its input ``h``, and the PAL site's adds
``TS_t(h)``. Saving and loading in the adapter format (:mod:`fastpals.adapters.format`)."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from fastpals.adapters.format import (
    check_same_pal_config,
    find_adapter_folder,
    join_name,
    load_adapter_tensors,
    read_adapter,
    trained_base_in_encoder,
    write_adapter,
)
from fastpals.adapters.targets import ResolvedTargets, builds_own_pals, is_known_model, resolve_targets
from fastpals.data.layout import BatchLayout, PaddedBatch, make_layout
from fastpals.encoder.bert import BertModel as MiniBert
from fastpals.encoder.bert import PALConfig, freeze_shared_parameters, task_specific_kind
from fastpals.encoder.fingerprint import check_encoder_fingerprint, encoder_fingerprint
from fastpals.encoder.pal_variants import PALLayer, PALProjections
from fastpals.functional import check_task_ids

__all__ = [
    "freeze_base_model",
    "inject_pals",
    "load_pals",
    "pal_state_dict",
    "remove_pals",
    "save_pals",
    "set_task",
    "trained_base_state_dict",
]

# the old format (read only, with a FutureWarning)
LEGACY_WEIGHTS_NAME = "pals.safetensors"
LEGACY_CONFIG_NAME = "pals_config.json"
# the fields of a saved adapter's ``encoder`` beside ``prefix`` and ``fingerprint``, named as in the injection
ENCODER_FIELDS = "model_type layers_pattern layer_norm_name hidden_size num_layers layer_indices".split()


#: the root model's attribute holding its :class:`PALInjection`
INJECTION_ATTR = "_fastpals_injection"


@dataclass(eq=False)
class PALInjection(ResolvedTargets):
    """What :func:`inject_pals` did to one model and the context its hooks share: an attribute of the root
    model whose bound methods are the hooks, so ``copy.deepcopy(model)`` gives hooks on the copy's state."""

    config: PALConfig
    layer_indices: list[int]
    mask_argument: str = "attention_mask"
    handles: list[Any] = field(default_factory=list)
    added: list[tuple[nn.Module, str]] = field(default_factory=list)  # (owner, attribute) of each new module
    default_task: int | torch.Tensor | None = None
    # False: the PALs add nothing (the base model's forward); PEFT's disable_adapter sets it
    enabled: bool = True
    frozen_base: bool = False  # set by freeze_base_model: save_pals then also saves the trained base weights
    modules_to_train: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._reset()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def pal_modules(self) -> list[nn.Module]:
        """The PAL modules this injection added (shared projections and per-layer PALs)."""
        return [getattr(owner, attr) for owner, attr in self.added]

    def _reset(self) -> None:
        self.depth = 0
        self.task_ids: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.layout: BatchLayout | None = None
        self.inputs: dict[int, torch.Tensor] = {}

    def enter(self, capture_mask: bool, is_root: bool, module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        """Pre-hook of the root model (``is_root``) and of the base model: take ``task_ids`` out of the
        keyword arguments and, on the base model (``capture_mask``), read the padding mask."""
        task_ids = kwargs.pop("task_ids", None)
        if is_root or self.depth == 0:
            self._reset()
        if task_ids is not None:
            self.task_ids = task_ids
        self.depth += 1
        if capture_mask:
            pos = self.mask_position
            positional = args[pos] if pos is not None and len(args) > pos else None
            self.mask, self.layout = kwargs.get(self.mask_argument, positional), None
        return args, kwargs

    def leave(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Forward hook (always called, also on errors) of the root and base models."""
        self.depth -= 1
        if self.depth <= 0:
            self._reset()

    def enter_minbert(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """minBERT takes task_ids itself; fill them in from :func:`set_task` when the call has none."""
        if kwargs.get("task_ids") is None and len(args) < 4 and self.default_task is not None:
            input_ids = args[0] if args else kwargs.get("input_ids")
            if not isinstance(input_ids, torch.Tensor):
                raise ValueError("set_task: the model was called without input_ids")
            kwargs["task_ids"] = self._default_task_ids(input_ids.shape[0], input_ids.device)
        return args, kwargs

    def keep_input(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.depth == 0:
            raise RuntimeError(
                f"PAL layer {index} ran outside the injected model's forward: call the model (or its base "
                "model) so the PALs get task_ids and the attention mask"
            )
        if getattr(module, "gradient_checkpointing", False) and module.training:
            self._wrap_checkpointing(index, module)
        h = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(h, torch.Tensor) or h.dim() != 3 or h.shape[-1] != self.hidden_size:
            got = list(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise ValueError(
                f"PAL layer {index}: expected the layer input [batch, length, {self.hidden_size}] as the "
                f"first argument or hidden_states=, got {got}"
            )
        self.inputs[index] = h

    def _wrap_checkpointing(self, index: int, layer: nn.Module) -> None:
        """HF gradient checkpointing runs the layer's forward again in the backward, after this model's
        forward has ended (no task ids, mask or layer input left here): wrap the layer's checkpointing
        function (again after each ``gradient_checkpointing_enable``) so that the replay sees the call's own
        context."""
        inner = getattr(layer, "_gradient_checkpointing_func", None)
        if inner is None or getattr(inner, "_fastpals_state", None) is self:
            return

        def checkpointing(fn: Any, *args: Any, **kwargs: Any) -> Any:
            saved = (self.task_ids, self.mask, self.layout, self.inputs.get(index))

            def run(*a: Any, **k: Any) -> Any:
                if self.depth > 0:  # the forward itself
                    return fn(*a, **k)
                self.task_ids, self.mask, self.layout, h = saved  # the replay, inside the backward
                self.inputs[index] = h
                self.depth += 1
                try:
                    return fn(*a, **k)
                finally:
                    self.depth -= 1
                    self._reset()

            return inner(run, *args, **kwargs)

        checkpointing._fastpals_state = self  # type: ignore[attr-defined]
        checkpointing._fastpals_inner = inner  # type: ignore[attr-defined]
        layer._gradient_checkpointing_func = checkpointing

    def _layer_input(self, index: int, site: str) -> torch.Tensor:
        """The input of layer ``index``, recorded by its pre-hook; ``site`` names the hook that needs it."""
        h = self.inputs.pop(index, None)
        if h is None:
            raise RuntimeError(
                f"{site} of layer {index} ran without its layer input (it ran twice, or outside the layer's "
                "forward)"
            )
        return h

    def add_pal(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        h = self._layer_input(index, "the final LayerNorm")
        if not self.enabled:
            return None
        x = args[0] if args else kwargs.pop("input")
        if x.shape != h.shape:
            raise ValueError(
                f"layer {index}: the final LayerNorm's input has shape {list(x.shape)} but the layer input "
                f"{list(h.shape)} (chunked feed-forward is not supported)"
            )
        return (self.layers[index].pal(h, self._layout(h), residual=x), *args[1:]), kwargs

    def add_pal_to_output(self, index: int, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """Forward hook of a ``site="output"`` target: its output ``[B, L, d]`` plus ``TS_t(h)``."""
        h = self._layer_input(index, "the PAL site")
        if not self.enabled:
            return None
        if not isinstance(output, torch.Tensor) or output.shape != h.shape:
            got = list(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ValueError(
                f"layer {index}: the PAL site's output is {got} but the layer input {list(h.shape)}"
            )
        return self.layers[index].pal(h, self._layout(h), residual=output)

    def _layout(self, h: torch.Tensor) -> BatchLayout:
        b, n = h.shape[0], h.shape[1]
        if self.layout is not None and self.layout.batch == b and self.layout.length == n:
            return self.layout
        mask = self.mask
        if mask is None:
            mask = torch.ones(b, n, dtype=torch.bool, device=h.device)
        elif not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != (b, n):
            got = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(
                f"PALs need {self.mask_argument} as a [batch, length] = [{b}, {n}] padding mask (1 = token), "
                f"got {got}"
            )
        if mask.device != h.device:
            raise ValueError(
                f"{self.mask_argument} is on {mask.device} but the hidden states are on {h.device}"
            )
        task_ids = self.task_ids
        if task_ids is None:
            if self.default_task is None:
                raise ValueError(
                    "this model has PALs: pass task_ids=[batch] int tensor (one task per example) to its "
                    "forward, or wrap the call in fastpals.set_task(model, task)"
                )
            task_ids = self._default_task_ids(b, h.device)
        compiling = (
            torch.compiler.is_compiling()
        )  # no host read in a compiled graph: the ids' range is the caller's
        task_ids = check_task_ids(task_ids, self.config.num_tasks, b, h.device, check_values=not compiling)
        if compiling:
            self.layout = PaddedBatch(mask, task_ids, self.config.num_tasks)
        else:
            self.layout = make_layout(mask, task_ids, False, (b, n))
        return self.layout

    def _default_task_ids(self, batch: int, device: torch.device) -> torch.Tensor:
        task = self.default_task
        if isinstance(task, torch.Tensor):
            return task.to(device)
        return torch.full((batch,), int(task), dtype=torch.long, device=device)


def get_injection(model: nn.Module, caller: str) -> PALInjection:
    """The injection state of ``model``; ``ValueError`` (naming ``caller``) when it has no PALs injected."""
    state = getattr(model, INJECTION_ATTR, None)
    if not isinstance(state, PALInjection):
        raise ValueError(
            f"{caller}: {type(model).__name__} has no PALs injected (call fastpals.inject_pals first)"
        )
    return state


def add_hf_pals(model: nn.Module, state: PALInjection, device: torch.device, dtype: torch.dtype) -> None:
    """Add the PAL modules (``<base>.pal_projections``, ``<layers>.{i}.pal``; ``device``, ``dtype``) to an HF
    model and register the hooks; both are recorded in ``state``."""
    base, config, indices = state.base, state.config, state.layer_indices
    clashes = [f"{state.base_name or '<root>'}.pal_projections"] if hasattr(base, "pal_projections") else []
    clashes += [f"{state.layers_pattern}.{i}.pal" for i in indices if hasattr(state.layers[i], "pal")]
    if clashes:
        raise ValueError(f"inject_pals: the model already has attributes named {clashes}")
    shared = None
    if config.shared_projections:
        shared = PALProjections(
            config.num_tasks, state.hidden_size, config.hidden, config.init_std, config.zero_init_decoder
        )
        base.add_module("pal_projections", shared.to(device=device, dtype=dtype))
        state.added.append((base, "pal_projections"))
    for i in indices:
        layer, norm = state.layers[i], state.layer_norms[i]
        pal = PALLayer(config, state.hidden_size, state.dropout, shared).to(device=device, dtype=dtype)
        pal.train(layer.training)
        layer.add_module("pal", pal)
        state.added.append((layer, "pal"))
        state.handles.append(layer.register_forward_pre_hook(partial(state.keep_input, i), with_kwargs=True))
        if state.site == "output":
            handle = norm.register_forward_hook(partial(state.add_pal_to_output, i), with_kwargs=True)
        else:
            handle = norm.register_forward_pre_hook(partial(state.add_pal, i), with_kwargs=True)
        state.handles.append(handle)
    callers = [(model, base is model, True)] + ([(base, True, False)] if base is not model else [])
    for module, capture_mask, is_root in callers:
        pre = partial(state.enter, capture_mask, is_root)
        state.handles.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        state.handles.append(module.register_forward_hook(state.leave, with_kwargs=True, always_call=True))


def inject_pals(
    model: nn.Module,
    config: PALConfig,
    *,
    layers_pattern: str | None = None,
    layer_norm_name: str | None = None,
    mask_argument: str = "attention_mask",
    freeze_base: bool = False,
    train_layer_norms: bool = True,
    modules_to_train: Iterable[str] = (),
) -> nn.Module:
    """Add PALs (one set per task, ``variant="parallel"``) in place to ``model``, an HF encoder (or a module
    holding one) or a :class:`fastpals.BertModel` without PALs, and return it. ``layers_pattern`` /
    ``layer_norm_name``: the layer list and each layer's final LayerNorm (default: :data:`TARGETS`);
    ``mask_argument``: the forward argument holding the ``[B, L]`` padding mask; ``freeze_base``: calls
    :func:`freeze_base_model`. PAL weights take the layers' device and dtype."""
    if getattr(model, INJECTION_ATTR, None) is not None:
        raise ValueError(f"inject_pals: {type(model).__name__} already has PALs injected")
    resolved = resolve_targets(model, config, layers_pattern, layer_norm_name, mask_argument)
    indices = config.layer_indices(len(resolved.layers))
    ref = next(resolved.layers[0].parameters(), None)
    device, dtype = (ref.device, ref.dtype) if ref is not None else (torch.device("cpu"), torch.float32)
    state = PALInjection(**vars(resolved), config=config, layer_indices=indices, mask_argument=mask_argument)
    if resolved.kind == "minbert":
        mini = resolved.base
        mini.add_pals(config)
        for owner, attr in [(mini, "pal_projections")] + [(mini.encoder.layer[i], "pal") for i in indices]:
            module = getattr(owner, attr)
            if module is not None:
                module.to(device=device, dtype=dtype)
                state.added.append((owner, attr))
        state.handles.append(model.register_forward_pre_hook(state.enter_minbert, with_kwargs=True))
    else:
        add_hf_pals(model, state, device, dtype)
    setattr(model, INJECTION_ATTR, state)
    if freeze_base:
        freeze_base_model(model, train_layer_norms=train_layer_norms, modules_to_train=modules_to_train)
    elif tuple(modules_to_train):
        raise ValueError("inject_pals: modules_to_train only applies with freeze_base=True")
    return model


def remove_pals(model: nn.Module) -> nn.Module:
    """Undo :func:`inject_pals`: remove the hooks and the PAL modules (``requires_grad`` flags stay)."""
    state = get_injection(model, "remove_pals")
    for handle in state.handles:
        handle.remove()
    for layer in state.layers:  # the HF checkpointing functions wrapped by the hooks
        func = getattr(layer, "_gradient_checkpointing_func", None)
        if getattr(func, "_fastpals_state", None) is state:
            layer._gradient_checkpointing_func = func._fastpals_inner
    for owner, attr in state.added:
        if attr in owner._modules:
            del owner._modules[attr]
        if state.kind == "minbert":
            setattr(owner, attr, None)
    if state.kind == "minbert":
        state.base.pal_config = None
    delattr(model, INJECTION_ATTR)
    return model


@contextlib.contextmanager
def set_task(model: nn.Module, task: int | torch.Tensor) -> Iterator[None]:
    """Run ``model`` with these task ids when the caller cannot pass ``task_ids``: an int (every example's
    task) or a ``[B]`` integer tensor. A ``task_ids`` argument wins over this; blocks nest."""
    state = get_injection(model, "set_task")
    if isinstance(task, bool) or not isinstance(task, (int, torch.Tensor)):
        raise TypeError(
            f"set_task: task must be an int or a [batch] integer tensor, got {type(task).__name__}"
        )
    if isinstance(task, int) and not 0 <= task < state.config.num_tasks:
        raise ValueError(f"set_task: task {task} is outside [0, {state.config.num_tasks})")
    if isinstance(task, torch.Tensor) and (task.dim() != 1 or task.dtype.is_floating_point):
        raise ValueError(f"set_task: a task tensor must be 1-D integer, got {task.dtype} {list(task.shape)}")
    previous = state.default_task
    state.default_task = task
    try:
        yield
    finally:
        state.default_task = previous


def pal_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The PAL parameters of an injected model, named relative to its base model (fastpals' names:
    ``pal_projections.*``, ``<layers>.{i}.pal.*``)."""
    state = get_injection(model, "pal_state_dict")
    names = {id(m): n for n, m in state.base.named_modules()}
    return {f"{names[id(m)]}.{k}": v for m in state.pal_modules() for k, v in m.state_dict().items()}


def freeze_base_model(
    model: nn.Module, train_layer_norms: bool = True, modules_to_train: Iterable[str] = ()
) -> dict[str, int]:
    """Freeze an injected ``model`` but its PALs, ``heads``, LayerNorms (with ``train_layer_norms``) and the
    ``modules_to_train`` (qualified names or their last parts, e.g. ``"classifier"``), which :func:`save_pals`
    then saves. Returns ``{"trainable": n, "frozen": m}`` element counts."""
    state = get_injection(model, "freeze_base_model")
    try:
        counts = freeze_shared_parameters(model, train_layer_norms, modules_to_train)
    except ValueError as err:
        raise ValueError(str(err).replace("freeze_shared_parameters", "freeze_base_model")) from None
    state.frozen_base = True
    state.modules_to_train = list(modules_to_train)
    return counts


def trained_base_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's parameters that are trainable (``requires_grad``), by their names in ``model``: after
    :func:`freeze_base_model`, the LayerNorms and ``modules_to_train``. PAL parameters are not included."""
    state = get_injection(model, "trained_base_state_dict")
    pal_ids = {id(p) for m in state.pal_modules() for p in m.parameters()}
    return {n: p for n, p in model.named_parameters() if p.requires_grad and id(p) not in pal_ids}


def save_pals(
    model: nn.Module,
    folder: str | os.PathLike,
    include_trained_base: bool | None = None,
    task_names: list[str] | None = None,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write ``model``'s adapter to ``folder``: its PALs, heads and, with ``include_trained_base``
    (default: after :func:`freeze_base_model`), the trained base weights. ``task_names`` default to ``task0,
    task1, ...``, ``base_model_name_or_path`` to the model's ``name_or_path``. Returns the folder."""
    if builds_own_pals(model):
        return model.save_pretrained(folder, adapters_only=True)
    state = get_injection(model, "save_pals")
    if include_trained_base is None:
        include_trained_base = state.frozen_base
    base_names = trained_base_state_dict(model) if include_trained_base else {}
    tensors, kwargs = adapter_contents(model, base_names, task_names, base_model_name_or_path, "save_pals")
    return write_adapter(folder, tensors, **kwargs)


def adapter_contents(
    model: nn.Module,
    base_names: Iterable[str],
    task_names: list[str] | None = None,
    base_model_name_or_path: str | None = None,
    caller: str = "save_pals",
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """What :func:`save_pals` writes for an injected ``model``: its PALs, heads and ``base_names`` (by their
    names in ``model``), and the fields of :func:`fastpals.adapters.format.adapter_config`."""
    state = get_injection(model, caller)
    pals = {join_name(state.base_name, k): v for k, v in pal_state_dict(model).items()}
    params = dict(model.named_parameters())
    heads = {n: p for n, p in params.items() if task_specific_kind(n) == "head"}
    unknown = sorted(set(base_names) - set(params))
    if unknown:
        raise ValueError(f"{caller}: {type(model).__name__} has no parameters named {unknown}")
    base = {k: params[k] for k in base_names if k not in heads}
    if task_names is None:
        task_names = [f"task{i}" for i in range(state.config.num_tasks)]
    if len(task_names) != state.config.num_tasks:
        raise ValueError(
            f"{caller}: {len(task_names)} task_names for {state.config.num_tasks} tasks ({task_names})"
        )
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(model, "name_or_path", None) or None
    lead = f"{state.base_name}." if state.base_name else ""
    encoder = model.get_submodule(state.base_name) if state.base_name else model
    kwargs = {
        "pal_config": state.config.to_dict(),
        "encoder": {
            "prefix": state.base_name,
            **{k: getattr(state, k) for k in ENCODER_FIELDS},
            "fingerprint": encoder_fingerprint(encoder, {n.removeprefix(lead) for n in base}),
        },
        "base_model_name_or_path": base_model_name_or_path,
        "task_names": list(task_names),
        "head_names": set(heads),
        "trained_base_names": set(base),
        "modules_to_save": list(state.modules_to_train) or None,
        "saved_from": type(model).__name__,
    }
    return {**pals, **heads, **base}, kwargs


def load_pals(
    model: nn.Module,
    folder: str | os.PathLike,
    load_trained_base: bool = True,
    strict: bool = False,
    force: bool = False,
) -> nn.Module:
    """Load an adapter (an adapter folder, or a full model folder's ``pals/``) into ``model`` (injected first
    if it has no PALs; a difference from the saved PALs is a ``ValueError``) and return it.
    ``load_trained_base``: also the trained base weights; saved tensors without a place in the model are an
    error with ``strict``, else a warning; an adapter trained beside another encoder is refused unless
    ``force``. Old folders: a FutureWarning."""
    if builds_own_pals(model):
        return model.load_adapter(folder, load_trained_base=load_trained_base, strict=strict, force=force)
    folder = Path(folder)
    if find_adapter_folder(folder) is None and (folder / LEGACY_CONFIG_NAME).is_file():
        warnings.warn(
            f"load_pals: {folder} is in the old format ({LEGACY_WEIGHTS_NAME}); save it again with save_pals "
            "to get adapter_config.json + adapter_model.safetensors",
            FutureWarning,
            stacklevel=2,
        )
        return _load_legacy_pals(model, folder, load_trained_base, strict)
    config, tensors, adapter = read_adapter(folder, "load_pals")
    source = str(adapter)
    prefix = prepare_for_adapter(model, config, source, "load_pals")
    check_encoder_fingerprint(
        config.get("encoder", {}).get("fingerprint"), model.get_submodule(prefix) if prefix else model,
        trained_base_in_encoder(config), source, "load_pals", force,
    )  # fmt: skip
    options = dict(load_trained_base=load_trained_base, strict=strict)
    load_adapter_tensors(model, prefix, config, tensors, source=source, caller="load_pals", **options)
    return model


def prepare_for_adapter(
    model: nn.Module, config: dict[str, Any], source: str, caller: str = "load_pals"
) -> str:
    """Give ``model`` the PALs an adapter ``config`` describes, or check that it has the same ones; returns
    where its encoder sits (``""``: the model itself). A difference is a ``ValueError`` naming ``source``."""
    if config.get("pal_config") is None:
        raise ValueError(
            f"{caller}: the adapter in {source} holds no PALs (saved from a model with pal=None)"
        )
    saved = PALConfig.from_dict(config["pal_config"])
    built = [(n, m) for n, m in model.named_modules() if isinstance(m, MiniBert) and m.task_specific]
    if getattr(model, INJECTION_ATTR, None) is None and len(built) == 1:  # a BertModel with its own PALs
        name, mini = built[0]
        check_same_pal_config(mini.pal_config.to_dict(), saved.to_dict(), source, caller)
        hidden, num_layers = mini.config.hidden_size, mini.config.num_hidden_layers
        _check_shape(config["encoder"], "encoder.layer", hidden, num_layers, source, caller)
        return name
    return _injected_like(model, saved, config["encoder"], source, caller).base_name


def _load_legacy_pals(model: nn.Module, folder: Path, load_trained_base: bool, strict: bool) -> nn.Module:
    """Load a folder of the old format (``pals_config.json``, ``pals.safetensors`` named from the base model,
    ``trained_base.safetensors``) with the checks of the new."""
    cfg_path, weights_path = folder / LEGACY_CONFIG_NAME, folder / LEGACY_WEIGHTS_NAME
    for path in (cfg_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"load_pals: {path} not found (not a folder written by save_pals)")
    try:
        meta = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"load_pals: {cfg_path} is not valid JSON ({e})") from None
    if meta.get("format") != "fastpals-pals" or meta.get("format_version") != 1:
        raise ValueError(
            f"load_pals: {cfg_path} has format {meta.get('format')!r} version "
            f"{meta.get('format_version')!r}; expected 'fastpals-pals' version 1"
        )
    prefix = _injected_like(model, PALConfig.from_dict(meta["pal_config"]), meta, folder).base_name
    pals = {join_name(prefix, k): v for k, v in load_file(str(weights_path)).items()}
    base = {}
    if meta.get("trained_base_parameters") and load_trained_base:
        base_path = folder / "trained_base.safetensors"
        if not base_path.is_file():
            raise FileNotFoundError(
                f"load_pals: {LEGACY_CONFIG_NAME} lists trained base parameters but {base_path} is missing"
            )
        base = load_file(str(base_path))
    cfg = {
        "encoder": {"prefix": prefix},
        "pal_parameters": pals,
        "head_parameters": {},
        "trained_base_parameters": base,
    }
    tensors = {**pals, **base}
    load_adapter_tensors(model, prefix, cfg, tensors, source=str(folder), caller="load_pals", strict=strict)
    return model


def _injected_like(
    model: nn.Module, saved: PALConfig, target: dict[str, Any], source: str | Path, caller: str = "load_pals"
) -> PALInjection:
    """Inject ``saved`` into ``model`` (where ``target``, a saved encoder description, says) or check that the
    PALs already injected are the same; any difference is a ``ValueError``. Returns the injection state."""
    state = getattr(model, INJECTION_ATTR, None)
    if state is None:
        targets = (
            {} if is_known_model(model) else {k: target[k] for k in ("layers_pattern", "layer_norm_name")}
        )
        resolved = resolve_targets(
            model, saved, targets.get("layers_pattern"), targets.get("layer_norm_name"), "attention_mask"
        )
        _check_shape(
            target, resolved.layers_pattern, resolved.hidden_size, len(resolved.layers), source, caller
        )
        inject_pals(model, saved, **targets)
        return get_injection(model, caller)
    _check_shape(target, state.layers_pattern, state.hidden_size, state.num_layers, source, caller)
    check_same_pal_config(state.config.to_dict(), saved.to_dict(), str(source), caller)
    return state


def _check_shape(
    meta: dict[str, Any], layers_pattern: str, hidden: int, num_layers: int, source: str | Path, caller: str
) -> None:
    saved = f"{caller}: the PALs in {source} were saved"
    if meta["layers_pattern"] != layers_pattern:
        raise ValueError(
            f"{saved} from a {meta['model_type']} model with layers at '{meta['layers_pattern']}' (parameter "
            f"names follow that path); this model's layers are at '{layers_pattern}'"
        )
    if meta["hidden_size"] != hidden:
        raise ValueError(f"{saved} for hidden size {meta['hidden_size']}, the model has hidden size {hidden}")
    if meta["num_layers"] != num_layers:
        raise ValueError(f"{saved} for a {meta['num_layers']}-layer model, the model has {num_layers} layers")
