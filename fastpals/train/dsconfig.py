"""DeepSpeed JSON configs: the shipped ones (``fastpals/configs/``), reading one and checking it; and
:func:`initialize`, DeepSpeed's set-up for ``python train.py`` without the launcher."""

from __future__ import annotations

import contextlib
import copy
import difflib
import gc
import importlib
import io
import logging
import os
import re
import socket
import sys
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from fastpals.encoder.precision import cpu_has_native_bf16
from fastpals.train.errors import ConfigError, read_json_object

DEFAULT_DS_CONFIG = "cpu_auto.json"

# bf16 where the CPU has no bf16 instructions: the matmuls are emulated in software
_EMULATED_BF16_NOTE = (
    "this CPU has no native bf16 (no avx512_bf16 / AMX): bf16 matmuls are emulated, measured over 20x slower "
    "than fp32 on a 2-core AVX2 EPYC"
)


def shipped_configs() -> dict[str, Path]:
    """``{name: path}`` of the configs shipped inside the package (they work from a wheel install too)."""
    folder = resources.files("fastpals") / "configs"
    return {p.name: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".json")}


def resolve_ds_config(path: str | os.PathLike) -> Path:
    """``path`` when it is a file, else the shipped config of that name (``cpu_bf16.json`` or
    ``configs/cpu_bf16.json`` from any folder), else :class:`ConfigError`."""
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    shipped = shipped_configs()
    if candidate.name in shipped and str(candidate.parent) in (".", "configs"):
        return shipped[candidate.name]
    raise ConfigError(
        f"--ds_config {path} does not exist (shipped configs, usable by name: {', '.join(sorted(shipped))})"
    )


def load_ds_config(path: str | os.PathLike) -> dict[str, Any]:
    """Read a DeepSpeed JSON config (a path or a shipped config's name); else :class:`ConfigError`."""
    return read_json_object(resolve_ds_config(path), "--ds_config ", "the top level must be a JSON object")


def _enabled(cfg: dict[str, Any], key: str) -> bool:
    section = cfg.get(key)
    return isinstance(section, dict) and section.get("enabled", False) is True


def _resolve_auto_precision(cfg: dict[str, Any], cuda: bool, native_bf16: bool | None, name: str) -> None:
    """Replace ``"bf16": {"enabled": "auto"}`` in place (bf16 where the GPU or CPU runs it natively, else
    fp32); any other non-boolean ``enabled`` is a :class:`ConfigError`."""
    for key in ("fp16", "bf16"):
        section = cfg.get(key)
        value = section.get("enabled", False) if isinstance(section, dict) else False
        if isinstance(value, bool):
            continue
        if key == "bf16" and value == "auto":
            if cuda:
                section["enabled"] = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
            else:
                section["enabled"] = cpu_has_native_bf16() if native_bf16 is None else native_bf16
            continue
        allowed = 'true, false or "auto"' if key == "bf16" else "true or false"
        raise ConfigError(f"{name}: {key}.enabled = {value!r}; use {allowed}")


def precision_note(
    requested: dict[str, Any],
    checked: dict[str, Any],
    cuda: bool | None = None,
    native_bf16: bool | None = None,
) -> str:
    """One line for the run's log: the training precision of ``checked`` (what :func:`check_ds_config` made of
    ``requested``) and why, its ZeRO stage and gradient accumulation dtype."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    native = cpu_has_native_bf16() if native_bf16 is None else native_bf16
    section = requested.get("bf16")
    auto = isinstance(section, dict) and section.get("enabled") == "auto"
    if _enabled(checked, "fp16"):
        reason = "fp16 (--ds_config)"
    elif _enabled(checked, "bf16") and not cuda and not native:
        reason = f"bf16 as --ds_config asks, but {_EMULATED_BF16_NOTE}: configs/cpu_auto.json picks fp32"
    elif _enabled(checked, "bf16"):
        why = "the GPU supports it" if cuda else "native on this CPU"
        reason = f"bf16 (bf16.enabled = auto: {why})" if auto else "bf16 (--ds_config)"
    elif auto:
        reason = "fp32 (bf16.enabled = auto: " + (
            "the GPU has no bf16)" if cuda else f"{_EMULATED_BF16_NOTE})"
        )
    else:
        reason = "fp32 (--ds_config)"
    stage = (checked.get("zero_optimization") or {}).get("stage", 0)
    accum = (checked.get("data_types") or {}).get("grad_accum_dtype")
    return f"precision: {reason}, ZeRO stage {stage}" + (f", {accum} gradient accumulation" if accum else "")


def _resolve_grad_accum_dtype(cfg: dict[str, Any], surgery: str, name: str) -> None:
    """Resolve ``"data_types": {"grad_accum_dtype": "auto"}`` in place: fp32 with bf16 + ZeRO-1 and no surgery
    (DeepSpeed's faster ``BF16_Optimizer``), else DeepSpeed's default. Explicit fp32 with surgery is refused:
    that optimizer takes each gradient during the backward, before the aggregator combines them."""
    types = cfg.get("data_types")
    if not isinstance(types, dict) or "grad_accum_dtype" not in types:
        return
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    bf16_zero1 = _enabled(cfg, "bf16") and stage == 1
    if types["grad_accum_dtype"] == "auto":
        if bf16_zero1 and surgery == "none":
            types["grad_accum_dtype"] = "fp32"
            cfg["bf16"].setdefault("immediate_grad_update", True)
        else:
            del types["grad_accum_dtype"]
            if not types:
                del cfg["data_types"]
        return
    if bf16_zero1 and surgery != "none" and types["grad_accum_dtype"] in ("fp32", "float32", "float"):
        raise ConfigError(
            f"{name}: data_types.grad_accum_dtype = fp32 with bf16 and ZeRO-1 runs DeepSpeed's BF16_Optimizer, "
            f"which takes the gradients before --surgery {surgery} combines them: delete the entry (or set it to "
            f'"auto")'
        )


def check_ds_config(
    cfg: dict[str, Any],
    batch_size: int,
    grad_accum: int,
    surgery: str = "none",
    world_size: int = 1,
    cuda: bool | None = None,
    name: str = "--ds_config",
    native_bf16: bool | None = None,
) -> dict[str, Any]:
    """A completed copy of DeepSpeed config ``cfg`` checked against the options: batch entries filled in,
    every ``"auto"`` resolved, every contradiction a :class:`ConfigError` naming the entry (``cuda``,
    ``native_bf16``: the machine's by default)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    out = copy.deepcopy(cfg)
    _resolve_auto_precision(out, cuda, native_bf16, name)
    zero = out.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("stage") == "auto":
        # ZeRO-1 where it earns its copies: fp32 master weights for bf16/fp16, or partitioned optimizer state
        zero["stage"] = 1 if _enabled(out, "bf16") or _enabled(out, "fp16") or world_size > 1 else 0
    _resolve_grad_accum_dtype(out, surgery, name)
    if (out.get("zero_optimization") or {}).get("stage", 0) in (1, 2):
        # ZeRO refuses torch optimizers it has not tested (fastpals' own --optimizer) unless told
        out.setdefault("zero_allow_untested_optimizer", True)
    accum = 1 if surgery != "none" else grad_accum
    micro = out.setdefault("train_micro_batch_size_per_gpu", batch_size)
    if micro != batch_size:
        raise ConfigError(
            f"{name}: train_micro_batch_size_per_gpu = {micro} but --batch-size {batch_size}: make them equal "
            f"(or delete the entry from the config)"
        )
    gas = out.setdefault("gradient_accumulation_steps", accum)
    if gas != accum:
        why = " (surgery accumulates the task batches of an update itself)" if surgery != "none" else ""
        raise ConfigError(
            f"{name}: gradient_accumulation_steps = {gas} but the run needs {accum} (--grad-accum {grad_accum}, "
            f"--surgery {surgery}){why}: set it to {accum} or delete it"
        )
    total = out.setdefault("train_batch_size", batch_size * accum * world_size)
    if total != batch_size * accum * world_size:
        raise ConfigError(
            f"{name}: train_batch_size = {total} but batch size {batch_size} x accumulation {accum} x "
            f"{world_size} rank(s) = {batch_size * accum * world_size}: fix it or delete it"
        )
    for key in ("optimizer", "scheduler"):
        if key in out:
            raise ConfigError(
                f"{name}: remove the {key!r} section; the optimizer and the warm-up/decay schedule come from "
                f"--optimizer, --lr, --pal-lr, --head-lr, --warmup, --weight-decay"
            )
    fp16, bf16 = _enabled(out, "fp16"), _enabled(out, "bf16")
    if fp16 and bf16:
        raise ConfigError(f"{name}: fp16 and bf16 are both enabled; enable one of them")
    if fp16 and not cuda:
        raise ConfigError(
            f"{name}: fp16 needs a CUDA GPU and none is available: use configs/cpu_auto.json on CPU"
        )
    stage = (out.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2):
        raise ConfigError(
            f"{name}: zero_optimization.stage = {stage}: fastpals trains with ZeRO 0, 1 or 2 (ZeRO-3 partitions "
            f"the stacked per-task PAL weights and is not supported)"
        )
    if bf16 and stage == 0 and not cuda:
        raise ConfigError(
            f"{name}: bf16 with ZeRO stage 0 on CPU runs DeepSpeed's FP16_UnfusedOptimizer without fp32 master "
            f"weights; use zero_optimization.stage 1 (configs/cpu_bf16.json)"
        )
    clip = out.get("gradient_clipping", 0.0)
    if not isinstance(clip, (int, float)) or clip < 0:
        raise ConfigError(f"{name}: gradient_clipping must be a number >= 0, got {clip!r}")
    check_ds_keys(out, name)
    return out


# DeepSpeed's top-level sections that deepspeed.runtime.constants does not name (DeepSpeed 0.19)
_DS_SECTIONS = (
    "zero_optimization", "monitor", "tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler",
    "activation_checkpointing", "comms_logger", "aio", "autotuning", "compression_training", "data_efficiency",
    "elasticity", "pipeline", "timers", "compile", "hybrid_engine", "curriculum_learning", "nebula",
    "weight_quantization", "amp", "sparse_gradients", "eigenvalue", "progressive_layer_drop", "quantize_training",
    "sparse_attention", "graph_harvesting", "load_universal_checkpoint", "tensor_parallel", "sequence_parallel_size",
    "zenflow", "deepcompile", "checkpoint",
)  # fmt: skip


_DATA_TYPES_KEYS = ("grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules")


def _model_keys(model: Any, path: tuple[Any, ...]) -> list[str]:
    """The keys a (nested) DeepSpeed pydantic section accepts at ``path``: field names and their aliases."""
    from pydantic import BaseModel  # comes with DeepSpeed

    for part in path:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return []
    fields = getattr(model, "model_fields", {})
    return sorted(set(fields) | {f.alias for f in fields.values() if f.alias})


def _unknown(name: str, key: str, valid: list[str] | set[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], sorted(valid), n=1, cutoff=0.6)
    prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
    hint = f": did you mean {prefix}{close[0]}?" if close else f" (valid {where}: {', '.join(sorted(valid))})"
    return ConfigError(f"{name}: unknown key {key!r}{hint}")


def check_ds_keys(cfg: dict[str, Any], name: str = "--ds_config") -> None:
    """Refuse what DeepSpeed would ignore or reject only after the set-up: an unknown key (naming the closest
    valid one) or a value DeepSpeed's own validation refuses."""
    if not torch.cuda.is_available():  # name the CPU accelerator before DeepSpeed's import: no guess printed
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:  # DeepSpeed's import takes seconds
        import deepspeed.runtime.constants as constants
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from pydantic import ValidationError
    except ImportError:  # no DeepSpeed here: it checks its config itself at the set-up
        return
    names = [v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)]
    valid = {v for v in names if re.fullmatch(r"[a-z][a-z0-9_]*", v)} | set(_DS_SECTIONS)
    models = {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config, "bfloat16": DeepSpeedBF16Config,
              "fp16": DeepSpeedFP16Config}  # fmt: skip
    for key in cfg:
        if key not in valid:
            raise _unknown(name, key, valid, "top-level keys")
    for key in cfg["data_types"] if isinstance(cfg.get("data_types"), dict) else ():
        if key not in _DATA_TYPES_KEYS:
            raise _unknown(name, f"data_types.{key}", list(_DATA_TYPES_KEYS), "data_types keys")
    for section, model in models.items():
        if section not in cfg:
            continue
        if not isinstance(cfg[section], dict):
            raise ConfigError(f"{name}: {section} must be a JSON object, got {cfg[section]!r}")
        try:
            model(**cfg[section])
        except ValidationError as err:
            first = err.errors()[0]
            loc = tuple(first.get("loc", ()))
            key = ".".join(str(p) for p in (section, *loc))
            if first.get("type") == "extra_forbidden" and loc:
                raise _unknown(name, key, _model_keys(model, loc[:-1]), f"{section} keys") from None
            value = f" = {first['input']!r}" if "input" in first and loc else ""
            raise ConfigError(f"{name}: {key}{value}: {first.get('msg', err)}") from None
        except (TypeError, ValueError, AssertionError) as err:
            raise ConfigError(
                f"{name}: {section}: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
            ) from None


def initialize(
    model: Any, optimizer: Any, scheduler: Any, config: dict, log: Any = print, verbose: bool = False
) -> tuple:
    """``deepspeed.initialize`` (``(engine, optimizer, loader, scheduler)``), also without the launcher; one
    process starts without the CPU shared-memory comm op (a ninja build of minutes). Without ``verbose``, what
    DeepSpeed prints is held back unless it fails; with it, DeepSpeed logs at INFO."""
    if verbose:
        from deepspeed.utils import logger  # DeepSpeed's import takes seconds

        logger.setLevel(logging.INFO)
        for handler in logger.handlers:
            handler.setLevel(logging.INFO)
    else:
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import deepspeed  # its import takes seconds

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    single = int(os.environ["WORLD_SIZE"]) == 1
    if not single and not torch.cuda.is_available():
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
        folder = Path(os.environ["TORCH_EXTENSIONS_DIR"])
        if not any(folder.glob("*/deepspeed_shm_comm/*.so")):
            log(f"[setup] building DeepSpeed's CPU shared-memory op once into {folder} (later runs reuse it)")
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # by name: the attribute is torch itself
    build_shm_op = ds_torch.build_shm_op
    if single:
        ds_torch.build_shm_op = lambda: None  # "op not available"
    held = io.StringIO()
    gc.freeze()  # DeepSpeed's set-up runs gc.collect() per parameter group: let it scan only new objects
    try:
        with contextlib.redirect_stdout(sys.stdout if verbose else held):
            out = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
            )
    except BaseException:
        sys.stdout.write(held.getvalue())
        raise
    finally:
        gc.unfreeze()
        ds_torch.build_shm_op = build_shm_op
    engine = out[0]
    # one rank: DeepSpeed's fallback all-reduce (ZeRO-0, BF16_Optimizer) copies every gradient through a
    # bucket for an identity; ZeRO-1/2's reduce_gradients also moves gradients into place, so it stays
    reduces = hasattr(engine.optimizer, "reduce_gradients")
    if single and not reduces and not engine.zero_optimization_partition_gradients():
        engine.enable_backward_allreduce = False
    return out
