"""The state of one :func:`fastpals.inject_pals` injection and its forward hooks: the root/base pre-hooks take
``task_ids`` and the ``[B, L]`` padding mask, each layer's pre-hook keeps its input ``h [B, L, d]``, and the
PAL site's hook adds ``TS_t(h)``. No HF module is replaced or renamed."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from fastpals.adapters.targets import ResolvedTargets
from fastpals.data.layout import BatchLayout, PaddedBatch, make_layout
from fastpals.encoder.bert import PALConfig, PALLayer, PALProjections
from fastpals.functional import check_task_ids

__all__ = ["INJECTION_ATTR", "PALInjection", "add_hf_pals", "get_injection"]

#: the root model's attribute holding its :class:`PALInjection`
INJECTION_ATTR = "_fastpals_injection"


@dataclass(eq=False)
class PALInjection(ResolvedTargets):
    """What :func:`inject_pals` did to one model (its targets, PALs and hooks), and the context its hooks
    share. A plain attribute of the root model whose bound methods are the hooks, so ``copy.deepcopy(model)``
    gives a copy whose hooks use the copy's state."""

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
                f"PAL layer {index} ran outside the injected model's forward: call the model (or its base model) "
                "so the PALs get task_ids and the attention mask"
            )
        if getattr(module, "gradient_checkpointing", False) and module.training:
            self._wrap_checkpointing(index, module)
        h = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(h, torch.Tensor) or h.dim() != 3 or h.shape[-1] != self.hidden_size:
            got = list(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__
            raise ValueError(
                f"PAL layer {index}: expected the layer input [batch, length, {self.hidden_size}] as the first "
                f"argument or hidden_states=, got {got}"
            )
        self.inputs[index] = h

    def _wrap_checkpointing(self, index: int, layer: nn.Module) -> None:
        """HF gradient checkpointing runs the layer's forward again in the backward, after this model's forward
        has ended (no task ids, mask or layer input left here): wrap the layer's checkpointing function (again
        after each ``gradient_checkpointing_enable``) so that the replay sees the call's own context."""
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
