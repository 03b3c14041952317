"""fastpals' PAL adapters as the PEFT method ``FASTPALS`` (``docs/api.md``): the forward takes ``task_ids
[B]`` or runs inside ``with peft_model.set_task("sts"):``; ``task_type`` stays None (PEFT's task wrappers drop
``task_ids``). One PAL adapter per model; PALs cannot be merged into the base weights."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import peft
import torch
from peft.config import PeftConfig
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
from peft.utils.peft_types import PeftType, TaskType, register_peft_method
from torch import nn

from fastpals.adapters.format import (
    FORMAT_VERSION,
    LIBRARY,
    PEFT_TYPE,
    adapter_config,
    check_adapter_tensors,
    plan_adapter_load,
    retarget,
)
from fastpals.adapters.inject import (
    INJECTION_ATTR,
    adapter_contents,
    get_injection,
    inject_pals,
    prepare_for_adapter,
    remove_pals,
    set_task,
    trained_base_state_dict,
)
from fastpals.encoder.bert import PALConfig, task_specific_kind

__all__ = ["METHOD_NAME", "PREFIX", "FastPalsConfig", "FastPalsModel", "register"]

#: the PEFT method name (PEFT wants it lower case; the ``PeftType`` member is ``FASTPALS``)
METHOD_NAME = PEFT_TYPE.lower()
#: PEFT's per-method prefix (unique among PEFT methods)
PREFIX = "fastpals_"
#: what PEFT puts in front of the model's parameter names in a ``PeftModel``'s state dict
_PEFT_MODEL_PREFIX = "base_model.model."
_CALLER = "FASTPALS adapter"
# adapter_config.json fields that describe the saved PALs (fastpals' format), refreshed on every save
_FORMAT_FIELDS = (
    "library_name fastpals_version format_version saved_from pal_config task_names encoder pal_parameters "
    "head_parameters trained_base_parameters modules_to_save"
).split()

_STATE_DICT_HOOKS = (
    "_get_adapter_state_dict",
    "_remove_adapter_name_from_key",
    "_remap_adapter_state_dict_for_load",
)
for _hook in _STATE_DICT_HOOKS:
    if not hasattr(BaseTuner, _hook):
        raise ImportError(
            f"fastpals' PEFT support needs peft>=0.21 (BaseTuner.{_hook}); peft {peft.__version__} is installed"
        )


def _add_peft_type_member() -> PeftType:
    """``PeftType.FASTPALS``, added to PEFT's enum if it is not there yet (``register_peft_method`` requires it)."""
    if PEFT_TYPE in PeftType.__members__:
        return PeftType[PEFT_TYPE]
    member = str.__new__(PeftType, PEFT_TYPE)
    member._name_ = member._value_ = PEFT_TYPE
    member.__objclass__ = PeftType
    member._sort_order_ = len(PeftType._member_names_)
    type.__setattr__(PeftType, PEFT_TYPE, member)
    PeftType._member_map_[PEFT_TYPE] = PeftType._value2member_map_[PEFT_TYPE] = member
    PeftType._member_names_.append(PEFT_TYPE)
    return member


FASTPALS = _add_peft_type_member()


@dataclass
class FastPalsConfig(PeftConfig):
    """PEFT config of fastpals' PALs. A new adapter takes ``pal_config`` (a :class:`fastpals.PALConfig` or its
    dict), ``task_names``, ``init_weights`` (V^D = 0: the base model's output), ``train_layer_norms``,
    ``modules_to_save`` and, for unknown architectures, ``layers_pattern`` / ``layer_norm_name``; the rest
    is the adapter format, written on save."""

    pal_config: dict[str, Any] | None = None
    task_names: list[str] | None = None
    init_weights: bool = True
    train_layer_norms: bool = True
    modules_to_save: list[str] | None = None
    layers_pattern: str | None = None
    layer_norm_name: str | None = None
    # fastpals' adapter format (filled in on save; read from a saved adapter)
    library_name: str = LIBRARY
    fastpals_version: str | None = None
    format_version: int = FORMAT_VERSION
    saved_from: str = ""
    tasks: list[dict[str, Any]] | None = None
    encoder: dict[str, Any] | None = None
    pal_parameters: dict[str, list[int]] = field(default_factory=dict)
    head_parameters: dict[str, list[int]] = field(default_factory=dict)
    trained_base_parameters: dict[str, list[int]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = FASTPALS
        if self.task_type in (TaskType.FEATURE_EXTRACTION, "FEATURE_EXTRACTION"):
            self.task_type = None
        elif self.task_type is not None:
            raise ValueError(
                f"FastPalsConfig: task_type={self.task_type!r} is not supported: PEFT's task-specific wrappers "
                "drop the task_ids argument the PALs need; leave task_type=None (and train a head with "
                "modules_to_save=['classifier'])"
            )
        if self.library_name != LIBRARY:
            raise ValueError(f"FastPalsConfig: library_name {self.library_name!r} is not {LIBRARY!r}")
        if self.format_version != FORMAT_VERSION:
            raise ValueError(
                f"FastPalsConfig: format_version {self.format_version!r}; this fastpals reads version "
                f"{FORMAT_VERSION}"
            )
        pal = self.pal_config
        pal = PALConfig() if pal is None else pal if isinstance(pal, PALConfig) else PALConfig.from_dict(pal)
        if self.encoder is None and self.init_weights:  # a new adapter (a saved one describes its encoder)
            pal = dataclasses.replace(pal, zero_init_decoder=True)
        self.pal_config = pal.to_dict()
        names = self.task_names
        self.task_names = [f"task{i}" for i in range(pal.num_tasks)] if names is None else list(names)
        if len(self.task_names) != pal.num_tasks:
            raise ValueError(
                f"FastPalsConfig: {len(self.task_names)} task_names for {pal.num_tasks} PAL tasks "
                f"({self.task_names})"
            )
        if self.modules_to_save is not None:
            self.modules_to_save = list(self.modules_to_save)

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, subfolder: str | None = None, **kwargs: Any
    ) -> PeftConfig:
        """``PeftConfig.from_pretrained``, remembering the folder for error messages."""
        config = super().from_pretrained(str(pretrained_model_name_or_path), subfolder=subfolder, **kwargs)
        path = str(pretrained_model_name_or_path)
        config._source = os.path.join(path, subfolder) if subfolder else path
        return config

    @property
    def source(self) -> str:
        """Where this config was read from (for messages)."""
        return getattr(self, "_source", None) or "the FASTPALS adapter config"


def _tuner_and_prefix(model: nn.Module) -> tuple[FastPalsModel, str]:
    """The FastPalsModel of a PeftModel (or the tuner itself) and the prefix of the model's parameter names in
    the state dict PEFT hands to the tuner's hooks."""
    if isinstance(model, FastPalsModel):
        return model, "model."
    tuner = getattr(model, "base_model", None)
    if isinstance(tuner, FastPalsModel):
        return tuner, _PEFT_MODEL_PREFIX
    raise TypeError(
        f"{_CALLER}: expected a peft.PeftModel with FASTPALS adapters, got {type(model).__name__} (fastpals PALs "
        "cannot be injected with peft.inject_adapter_in_model: use get_peft_model or fastpals.inject_pals)"
    )


class FastPalsModel(BaseTuner):
    """The PEFT tuner of fastpals' PALs: ``PeftModel(model, FastPalsConfig(...))`` puts one in
    ``peft_model.base_model``. Created by ``peft.get_peft_model`` / ``peft.PeftModel.from_pretrained``."""

    prefix: str = PREFIX
    # PALs are new submodules plus forward hooks (fastpals.inject_pals); no module of the model is replaced by a
    # PEFT tuner layer, so PEFT's generic layer walks find none.
    tuner_layer_cls = BaseTunerLayer
    target_module_mapping: dict[str, list[str]] = {}
    # V^E/V^D are shared by the layers: peft.inject_adapter_in_model (which returns only the model) refuses it
    uses_shared_state = True

    def inject_adapter(
        self,
        model: nn.Module,
        adapter_name: str,
        autocast_adapter_dtype: bool = True,
        low_cpu_mem_usage: bool = False,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Give ``model`` the PALs of ``self.peft_config[adapter_name]`` (new, or a saved adapter's checked
        against the model) and set which parameters train."""
        config = self.peft_config[adapter_name]
        others = [n for n in self.peft_config if n != adapter_name]
        if others:
            raise ValueError(
                f"{_CALLER}: the model already has the PAL adapter {others[0]!r}; one PAL adapter holds the PALs of "
                "every task (select a task with task_ids= or set_task), so a model takes only one"
            )
        try:
            if config.encoder is None:  # a new adapter
                inject_pals(
                    model,
                    PALConfig.from_dict(config.pal_config),
                    layers_pattern=config.layers_pattern,
                    layer_norm_name=config.layer_norm_name,
                    freeze_base=True,
                    train_layer_norms=config.train_layer_norms,
                    modules_to_train=config.modules_to_save or (),
                )
                self._base_names = list(trained_base_state_dict(model))
            else:
                self._base_names = self._saved_base_names(model, config)
        except NotImplementedError as err:
            if "meta tensor" not in str(err):
                raise
            raise ValueError(
                f"{_CALLER}: low_cpu_mem_usage=True is not supported (fastpals creates the PALs with their "
                "weights, not on the meta device); load without it"
            ) from None
        state = get_injection(model, _CALLER)
        self._adapter_name = adapter_name
        self.targeted_module_names = [
            ".".join(p for p in (state.base_name, state.layers_pattern, str(i)) if p)
            for i in state.layer_indices
        ]
        self.active_adapter = adapter_name
        self._mark_only_adapters_as_trainable(model)

    @staticmethod
    def _saved_base_names(model: nn.Module, config: FastPalsConfig) -> list[str]:
        """Give ``model`` the PALs of a saved adapter (where it says, or an error naming what differs);
        returns the names of the base parameters the adapter trains and saves."""
        encoder_prefix = prepare_for_adapter(model, config.to_dict(), config.source, _CALLER)
        if getattr(model, INJECTION_ATTR, None) is None:
            raise ValueError(
                f"{_CALLER}: {type(model).__name__} holds a fastpals.BertModel built with its own PALs; "
                "PEFT support covers injected PALs: load it with fastpals.load_pals or "
                "MultiTaskBert.from_pretrained"
            )
        get_injection(model, _CALLER).modules_to_train = list(config.modules_to_save or [])
        params = dict(model.named_parameters())
        return [
            name
            for k in [*config.head_parameters, *config.trained_base_parameters]
            if (name := retarget(k, config.encoder["prefix"], encoder_prefix)) in params
            and task_specific_kind(name) != "head"
        ]

    def _adapter_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The adapter's parameters in the model: PALs, task heads, and its trained base weights."""
        state = get_injection(self.model, _CALLER)
        pal_ids = {id(p) for m in state.pal_modules() for p in m.parameters()}
        base = set(self._base_names)
        return [
            (n, p)
            for n, p in self.model.named_parameters()
            if id(p) in pal_ids or n in base or task_specific_kind(n) == "head"
        ]

    def _mark_only_adapters_as_trainable(self, model: nn.Module) -> None:
        """Freeze the model except the adapter's parameters (all of them frozen in inference mode)."""
        trainable = not self.peft_config[self._adapter_name].inference_mode
        own = {id(p) for _, p in self._adapter_parameters()}
        for p in model.parameters():
            p.requires_grad = trainable and id(p) in own

    def set_requires_grad(self, adapter_names: str | list[str], requires_grad: bool = True) -> None:
        """Switch gradients of the adapter's parameters on or off."""
        self._check_adapter_names(adapter_names)
        for _, p in self._adapter_parameters():
            p.requires_grad = requires_grad

    def set_adapter(self, adapter_name: str | list[str], inference_mode: bool = False) -> None:
        """Make the (one) PAL adapter active; ``inference_mode`` freezes it."""
        names = self._check_adapter_names(adapter_name)
        self.active_adapter = adapter_name
        if inference_mode:
            self.set_requires_grad(names, False)

    def _check_adapter_names(self, names: str | list[str]) -> list[str]:
        names = [names] if isinstance(names, str) else list(names)
        unknown = [n for n in names if n not in self.peft_config]
        if unknown:
            raise ValueError(
                f"{_CALLER}: no adapter named {unknown}; this model has {list(self.peft_config)}"
            )
        return names

    def _create_and_replace(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("FastPalsModel adds its PALs in inject_adapter (fastpals.inject_pals)")

    def _prepare_adapter_config(self, peft_config: PeftConfig, model_config: dict) -> PeftConfig:
        return peft_config

    @contextlib.contextmanager
    def set_task(self, task: int | str | torch.Tensor) -> Iterator[None]:
        """Run the model's calls in this block (passing no ``task_ids``) with a name of ``task_names``, an
        index, or a ``[B]`` tensor of indices (:func:`fastpals.set_task`)."""
        names = self.peft_config[self._adapter_name].task_names
        if isinstance(task, str):
            if task not in names:
                raise ValueError(f"set_task: unknown task {task!r}; the PAL tasks are {names}")
            task = names.index(task)
        with set_task(self.model, task):
            yield

    def _enable_adapter_layers(self, enabled: bool = True) -> None:
        state = get_injection(self.model, _CALLER)
        if state.kind != "hf":
            raise NotImplementedError(f"{_CALLER}: PALs in a fastpals.BertModel cannot be switched off")
        state.enabled = enabled

    def delete_adapter(self, adapter_name: str) -> None:
        """Remove the PALs from the model (:func:`fastpals.remove_pals`) and forget the adapter."""
        self._check_adapter_names(adapter_name)
        remove_pals(self.model)
        del self.peft_config[adapter_name]
        self.active_adapter = []

    def merge_adapter(self, adapter_names: list[str] | None = None, safe_merge: bool = False) -> None:
        """Refused: PALs cannot be merged into the base weights."""
        raise ValueError(
            f"{_CALLER}: PALs cannot be merged into the base weights (each task adds its own projected attention "
            "to every layer); keep the PeftModel, or use unload() to get the base model back"
        )

    def merge_and_unload(self, *args: Any, **kwargs: Any) -> nn.Module:
        """Refused: PALs cannot be merged into the base weights."""
        self.merge_adapter()
        return self.model

    def unload(self) -> nn.Module:
        """Remove the PALs (:func:`fastpals.remove_pals`) and return the base model."""
        if getattr(self.model, INJECTION_ATTR, None) is not None:
            remove_pals(self.model)
        return self.model

    @classmethod
    def _get_adapter_state_dict(
        cls,
        model: nn.Module,
        config: PeftConfig,
        adapter_name: str,
        state_dict: dict[str, torch.Tensor],
        unwanted_adapter_names: list[str],
    ) -> dict[str, torch.Tensor]:
        """The adapter's tensors (what :func:`fastpals.save_pals` saves: PALs, heads, trained base weights), keyed
        as in ``state_dict``; also refreshes the config's fastpals fields, so the ``adapter_config.json`` that
        PEFT writes next describes them (fastpals' loaders check that)."""
        tuner, prefix = _tuner_and_prefix(model)
        tensors, kwargs = adapter_contents(
            tuner.model, tuner._base_names, config.task_names, config.base_model_name_or_path, _CALLER
        )
        described = adapter_config(tensors, **kwargs)
        for key in _FORMAT_FIELDS:
            setattr(config, key, described[key])
        if not kwargs["head_names"]:
            config.tasks = None  # task specs describe heads; without heads they would describe nothing
        return {prefix + k: state_dict.get(prefix + k, v) for k, v in tensors.items()}

    @classmethod
    def _remove_adapter_name_from_key(cls, key: str, adapter_name: str) -> str:
        """Checkpoint names are the model's own parameter names (fastpals' format): drop PEFT's prefix."""
        return key.removeprefix(_PEFT_MODEL_PREFIX)

    @classmethod
    def _remap_adapter_state_dict_for_load(
        cls, model: nn.Module, config: PeftConfig, adapter_name: str, state_dict: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The saved tensors, checked as :func:`fastpals.load_pals` does (a warning names those the model has
        no place for), keyed as the PEFT model's state dict."""
        tuner, prefix = _tuner_and_prefix(model)
        if config.encoder is None:
            raise ValueError(
                f"{_CALLER}: the adapter {adapter_name!r} was created here, not loaded, so its config describes "
                "no saved tensors; load saved PALs with peft.PeftModel.from_pretrained"
            )
        described = config.to_dict()
        state_dict = {k.removeprefix(_PEFT_MODEL_PREFIX): v for k, v in state_dict.items()}
        check_adapter_tensors(
            described, state_dict, f"the weights of {config.source} do not match its config", _CALLER
        )
        base_name = get_injection(tuner.model, _CALLER).base_name
        copies, _ = plan_adapter_load(
            tuner.model, base_name, described, state_dict, source=config.source, caller=_CALLER, strict=False
        )
        return {prefix + name: tensor for name, tensor in copies}


def register() -> None:
    """Register the ``fastpals`` PEFT method (idempotent)."""
    if PEFT_TYPE_TO_CONFIG_MAPPING.get(FASTPALS) is FastPalsConfig:
        return
    if FASTPALS in PEFT_TYPE_TO_CONFIG_MAPPING or FASTPALS in PEFT_TYPE_TO_TUNER_MAPPING:
        raise RuntimeError(f"another {PEFT_TYPE} PEFT method is registered (another fastpals import?)")
    register_peft_method(name=METHOD_NAME, config_cls=FastPalsConfig, model_cls=FastPalsModel, prefix=PREFIX)


register()
