"""``--surgery-memory buffer|stream|auto``: what one-backward surgery builds (:func:`task_gradients`), and
``auto``'s choice (:func:`choose_memory_mode`) from the predicted peak, ``[T, P]`` rows and the activations
(:func:`estimate_activation_bytes`: fitted to the planner's traces of MiniLM-L6 and BERT-base)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from fastpals.surgery import (
    AGGREGATORS,
    StreamingTaskGradients,
    TaskGradientBuffer,
    TaskGradients,
    shared_parameters_by_name,
)
from fastpals.train.memory_states import model_state_bytes

#: ``--surgery-memory`` of one-backward surgery: the [T, P] buffer, streaming, or auto
SURGERY_MEMORIES = ("buffer", "stream", "auto")
#: what each mode of :func:`surgery_memory_mode` holds (the run's set-up line says it)
SURGERY_MEMORY_TEXT = {
    "buffer": "buffer memory mode ([tasks, shared parameters] gradient rows)",
    "stream": "stream memory mode (Gram layer by layer, no [tasks, shared parameters] rows)",
    "smaller": "auto memory mode: streaming, with a layer's task rows kept where smaller than its kept activations "
    "and the first layers' within a budget",
}

#: the buffer is kept only while its predicted peak is at most this share of the device's memory
FIT_SHARE = 0.9
#: ... and while its ``[T, P]`` rows are at most this share of the step's activations
ROWS_SHARE = 1.0
#: ``auto``'s streaming: the first layers' Linear task rows are kept within this share of the activations (net of
#: the ``dY`` and ``X`` they spare)
KEEP_SHARE = 0.5
#: bytes per saved activation element: fp32, and fp16/bf16 training (some saved tensors stay fp32 or bool)
_ELEMENT_BYTES = {"fp32": 4.0, "bf16": 2.4, "fp16": 2.4}
#: saved elements per token and layer: ``_PER_HIDDEN * hidden + _PER_SCORE * heads * length`` (fitted, see above)
_PER_HIDDEN, _PER_SCORE = 24.0, 3.4


@dataclass(frozen=True)
class MemoryModeChoice:
    """:func:`choose_memory_mode`'s ``mode`` (``buffer`` or ``stream``), ``why`` (one line) and, for
    ``stream``, ``keep_bytes`` (the budget of kept Linear rows)."""

    mode: str
    why: str
    keep_bytes: int = 0


def surgery_memory_mode(
    option: str, one_backward: bool, buffer_dtype: str = "fp32", auto_pick: str | None = None
) -> str:
    """``--surgery-memory`` -> ``buffer``, ``stream`` or ``smaller`` (``auto``'s streaming); ``auto`` is the
    buffer with per-task backwards, bf16 rows, or where ``auto_pick`` is ``buffer``."""
    if option != "auto":
        return option
    return "buffer" if not one_backward or buffer_dtype == "bf16" or auto_pick == "buffer" else "smaller"


def task_gradients(
    memory: str,
    params: list[torch.nn.Parameter],
    num_tasks: int,
    dtype: torch.dtype | None = None,
    keep_bytes: int = 0,
    **kwargs: Any,
) -> TaskGradients:
    """The per-task gradients of a :func:`surgery_memory_mode`: a ``TaskGradientBuffer`` of ``dtype`` rows or
    ``StreamingTaskGradients`` (``smaller``: ``keep_bytes`` of kept Linear rows); ``kwargs`` go to either."""
    if memory not in SURGERY_MEMORY_TEXT:
        raise ValueError(f"surgery memory {memory!r}: choose one of {', '.join(SURGERY_MEMORY_TEXT)}")
    if memory == "buffer":
        return TaskGradientBuffer(params, num_tasks, dtype, **kwargs)
    policy, keep = ("stream", 0) if memory == "stream" else ("smaller", keep_bytes)
    return StreamingTaskGradients(params, num_tasks, policy=policy, keep_bytes=keep, **kwargs)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def choose_memory_mode(
    rows_bytes: int,
    activation_bytes: int,
    buffer_peak_bytes: int,
    device_bytes: int,
    fit_share: float = FIT_SHARE,
    rows_share: float = ROWS_SHARE,
    keep_share: float = KEEP_SHARE,
) -> MemoryModeChoice:
    """``auto``'s pick from byte counts per rank (``device_bytes`` 0: fit not checked); streaming keeps
    ``keep_share`` of the activations in Linear rows, at most what the device leaves above its peak."""
    keep = keep_bytes(activation_bytes, keep_share)
    if device_bytes > 0:  # the kept rows come on top of the streamed peak (about the buffer's, less its rows)
        keep = max(0, min(keep, int(fit_share * device_bytes) - (buffer_peak_bytes - rows_bytes)))
    kept = f"; the first layers' Linear task rows kept within {_mib(keep)}" if keep else ""
    if device_bytes > 0 and buffer_peak_bytes > fit_share * device_bytes:
        why = (
            f"the buffer's predicted peak {_mib(buffer_peak_bytes)} is over {fit_share:.0%} of the device's "
        )
        return MemoryModeChoice("stream", f"{why}{_mib(device_bytes)}{kept}", keep)
    activations = f"of the activations (~{_mib(activation_bytes)})"
    if rows_bytes > rows_share * activation_bytes:
        why = f"the [T, P] rows ({_mib(rows_bytes)}) are over {rows_share:.0%} {activations}{kept}"
        return MemoryModeChoice("stream", why, keep)
    why = f"the buffer's peak {_mib(buffer_peak_bytes)} fits and its rows ({_mib(rows_bytes)}) are at most"
    return MemoryModeChoice("buffer", f"{why} {rows_share:.0%} {activations}")


def keep_bytes(activation_bytes: int, share: float = KEEP_SHARE) -> int:
    """``auto``'s streaming budget of kept Linear task rows: ``share`` of the step's activations, in bytes."""
    return int(share * activation_bytes)


def keep_bytes_for(config: Any, tokens: int, length: int, precision: str = "fp32") -> int:
    """:func:`keep_bytes` of a step of ``tokens`` tokens in sequences of ``length`` through the encoder of
    ``config`` (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``): ``auto``'s budget on one rank."""
    c = config
    return keep_bytes(
        estimate_activation_bytes(
            tokens, length, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, precision
        )
    )


def estimate_activation_bytes(
    tokens: int, length: int, hidden: int, layers: int, heads: int, precision: str = "fp32"
) -> int:
    """Saved activation bytes of one forward of ``tokens`` tokens in sequences of ``length`` through
    ``layers`` encoder layers (width ``hidden``, ``heads`` heads; PALs and heads included): the fitted formula."""
    per_token_layer = _PER_HIDDEN * hidden + _PER_SCORE * heads * length
    return int(tokens * layers * per_token_layer * _ELEMENT_BYTES.get(precision, 4.0))


def device_memory_bytes(device: torch.device | str) -> int:
    """The memory of ``device``: a CUDA device's total memory, or this host's memory for the CPU (0: unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def run_memory_mode(
    module: torch.nn.Module,
    num_tasks: int,
    shared_elements: int,
    row_bytes: int,
    tokens: int,
    length: int,
    precision: str,
    zero_stage: int,
    world_size: int,
    device: torch.device | str,
) -> MemoryModeChoice:
    """The trainer's ``auto``: :func:`choose_memory_mode` with the device's memory and analytic estimates
    (``module``: the multi-task model; ``tokens``: a micro-batch's, rows full length; ``row_bytes``: 4 or 2)."""
    config: Any = getattr(getattr(module, "bert", module), "config", None)
    hidden = int(getattr(config, "hidden_size", 768))
    activations = estimate_activation_bytes(
        tokens, length, hidden, int(getattr(config, "num_hidden_layers", 12)),
        int(getattr(config, "num_attention_heads", max(1, hidden // 64))), precision,
    )  # fmt: skip
    trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    states = model_state_bytes(trained, precision, zero_stage, world_size).total
    rows = num_tasks * shared_elements * row_bytes
    return choose_memory_mode(
        rows, activations, states + activations + rows, device_memory_bytes(device),
        keep_share=KEEP_SHARE if world_size == 1 else 0.0,
    )  # fmt: skip


def trainer_memory_mode(trainer: Any) -> tuple[str, torch.dtype, MemoryModeChoice | None]:
    """A ``Trainer``'s :func:`surgery_memory_mode`, the rows' dtype (``auto``: bf16 with bf16 training, else
    fp32) and ``auto``'s :func:`run_memory_mode` choice (None where it did not run)."""
    args, ds_config, module = trainer.args, trainer.ds_config, trainer.engine.module
    bf16 = ds_config.get("bf16", {}).get("enabled")
    rows = args.surgery_buffer_dtype if args.surgery_buffer_dtype != "auto" else "bf16" if bf16 else "fp32"
    one_backward, choice, option = args.batching == "mixed", None, args.surgery_memory
    if getattr(AGGREGATORS.get(args.surgery), "reads_rows", False):  # ExcessMTL: the [T, P] rows themselves
        option = "buffer"
    if surgery_memory_mode(option, one_backward, args.surgery_buffer_dtype) == "smaller":
        precision = "bf16" if bf16 else "fp16" if ds_config.get("fp16", {}).get("enabled") else "fp32"
        shared = sum(p.numel() for p in shared_parameters_by_name(module)[0])
        tokens, n = args.max_tokens or args.batch_size * args.max_length, len(args.task_list)
        row_bytes = 2 if rows == "bf16" else 4
        choice = run_memory_mode(
            module, n, shared, row_bytes, tokens, args.max_length, precision, trainer.zero_stage,
            trainer.world_size, trainer.device,
        )  # fmt: skip
    memory = surgery_memory_mode(option, one_backward, args.surgery_buffer_dtype, choice and choice.mode)
    return memory, torch.bfloat16 if rows == "bf16" else torch.float32, choice


def plan_auto_modes(
    bert: Any,
    num_tasks: int,
    shared_elements: int,
    tokens: int,
    length: int,
    precision: str,
    rows_dtype: str,
    buffer_dtype: str,
    buffer_peak_bytes: int,
    devices: dict[str, int],
) -> dict[str, dict[str, str]]:
    """``fastpals memory``'s ``auto`` per device, ``{name: {"mode", "why"}}``: :func:`choose_memory_mode` with
    the traced buffer peak and each device's usable bytes; ``bert``: the encoder config."""
    if buffer_dtype == "bf16":
        return {n: {"mode": "buffer", "why": "bf16 rows asked for"} for n in devices}
    activations = estimate_activation_bytes(
        tokens, length, bert.hidden_size, bert.num_hidden_layers, bert.num_attention_heads, precision
    )
    rows = num_tasks * shared_elements * (2 if rows_dtype == "bf16" else 4)
    choices = {
        name: choose_memory_mode(rows, activations, buffer_peak_bytes, n) for name, n in devices.items()
    }
    return {name: {"mode": c.mode, "why": c.why} for name, c in choices.items()}
