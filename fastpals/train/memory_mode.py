"""Which memory mode ``--surgery-memory auto`` picks for one-backward surgery: the buffer or streaming.

One rule, :func:`choose_memory_mode`, serves ``fastpals memory`` (per GPU, with the traced buffer-mode peak) and
the trainer (with the run's device memory and the analytic numbers below: no trace at start-up, it costs
seconds):

- **buffer** where the buffer-mode peak fits the device with a margin (at most :data:`FIT_SHARE` of its memory)
  and the ``[T, P]`` rows are small beside the activations (``T * P * bytes <= ROWS_SHARE * activations``, with
  :data:`ROWS_SHARE` = 1: the rows are made while the backward frees the activations, so up to that size they
  take the activations' place and do not raise the peak; traced, BERT-base, 8 tasks, 32 x 128 tokens, bf16, ZeRO-1
  with DeepSpeed's gradient buckets: buffer 4.23 GiB, stream 4.22 GiB, rows 1.63 GiB);
- **stream** otherwise: the buffer would not fit, or its rows would make the peak (then the streamed step is the
  same update at about the plain step's peak, for one more weight-gradient GEMM pass). ``auto``'s streaming keeps
  the task rows of the first layers' Linear weights where what they add over the ``dY`` and ``X`` they spare is
  within :data:`KEEP_SHARE` of the activations (``keep_bytes`` of
  :class:`~fastpals.surgery.StreamingTaskGradients`): those layers skip the second weight-gradient pass. MiniLM,
  16 tasks, 48 x 32 tokens, one CPU thread: 17 of 37 Linear weights kept, the step 1.37-1.42x -> 1.25-1.29x the
  plain step's time for a peak of 1.01x -> 1.12x (``docs/surgery-scaling.md``).

The numbers: the rows are exact (``T * P * bytes`` of the rows' dtype); the activations are
:func:`estimate_activation_bytes`, a per-token, per-layer formula fitted to the planner's traces of MiniLM-L6 and
BERT-base at 32 and 128 tokens (within about 15 % of them; ``tests/test_memory_mode.py``); the trainer's buffer-mode
peak is model states (``fastpals.train.memory_states.model_state_bytes``) + activations + rows, an upper bound of the
traced one (the rows are made while the backward frees activations).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from fastpals.train.memory_states import model_state_bytes

__all__ = [
    "FIT_SHARE",
    "KEEP_SHARE",
    "ROWS_SHARE",
    "MemoryModeChoice",
    "choose_memory_mode",
    "device_memory_bytes",
    "estimate_activation_bytes",
    "keep_bytes",
    "keep_bytes_for",
    "run_memory_mode",
]

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
    """What :func:`choose_memory_mode` decided: ``mode`` (``buffer`` or ``stream``), ``why`` (one line) and, for
    ``stream``, ``keep_bytes`` (:class:`~fastpals.surgery.StreamingTaskGradients`'s budget of kept Linear rows)."""

    mode: str
    why: str
    keep_bytes: int = 0


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
    """``auto``'s pick from host-known byte counts (Python ints, per rank).

    Args:
        rows_bytes: the buffer's ``[T, P]`` rows, ``T * P * bytes``.
        activation_bytes: the step's saved activations (traced or :func:`estimate_activation_bytes`).
        buffer_peak_bytes: the predicted peak of the step in buffer mode (rows included).
        device_bytes: the memory the device leaves to tensors (0: unknown, the fit is not checked).
        fit_share, rows_share: the margins (:data:`FIT_SHARE`, :data:`ROWS_SHARE`).
        keep_share: streaming's kept Linear rows, a share of the activations (:data:`KEEP_SHARE`; 0: none, as
            data parallel runs, whose streaming ignores ``keep_bytes``), at most what the device leaves above
            the streamed peak (taken as the buffer's peak less its rows) within ``fit_share``.
    """
    keep = keep_bytes(activation_bytes, keep_share)
    if device_bytes > 0:  # the kept rows come on top of the streamed peak (about the buffer's, less its rows)
        keep = max(0, min(keep, int(fit_share * device_bytes) - (buffer_peak_bytes - rows_bytes)))
    kept = f"; the first layers' Linear task rows kept within {_mib(keep)}" if keep else ""
    if device_bytes > 0 and buffer_peak_bytes > fit_share * device_bytes:
        return MemoryModeChoice(
            "stream",
            f"the buffer's predicted peak {_mib(buffer_peak_bytes)} is over {fit_share:.0%} of the device's "
            f"{_mib(device_bytes)}{kept}",
            keep,
        )
    if rows_bytes > rows_share * activation_bytes:
        return MemoryModeChoice(
            "stream",
            f"the [T, P] rows ({_mib(rows_bytes)}) are over {rows_share:.0%} of the activations "
            f"(~{_mib(activation_bytes)}){kept}",
            keep,
        )
    return MemoryModeChoice(
        "buffer",
        f"the buffer's peak {_mib(buffer_peak_bytes)} fits and its rows ({_mib(rows_bytes)}) are at most "
        f"{rows_share:.0%} of the activations (~{_mib(activation_bytes)})",
    )


def keep_bytes(activation_bytes: int, share: float = KEEP_SHARE) -> int:
    """``auto``'s streaming budget of kept Linear task rows (``keep_bytes`` of
    :class:`~fastpals.surgery.StreamingTaskGradients`): ``share`` of the step's activations, in bytes."""
    return int(share * activation_bytes)


def keep_bytes_for(config: Any, tokens: int, length: int, precision: str = "fp32") -> int:
    """:func:`keep_bytes` of a step of ``tokens`` tokens in sequences of ``length`` through the encoder of
    ``config`` (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``), its activations estimated by
    :func:`estimate_activation_bytes`: the budget ``auto``'s streaming runs with on one rank."""
    c = config
    activations = estimate_activation_bytes(
        tokens, length, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, precision
    )
    return keep_bytes(activations)


def estimate_activation_bytes(
    tokens: int, length: int, hidden: int, layers: int, heads: int, precision: str = "fp32"
) -> int:
    """The saved activations of one forward of ``tokens`` tokens in sequences of ``length`` through ``layers``
    encoder layers of width ``hidden`` with ``heads`` attention heads (PALs and heads included), in bytes: a
    formula fitted to the planner's traces (see the module's docstring)."""
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
    """The trainer's ``auto``: :func:`choose_memory_mode` with the run's device memory and the analytic numbers
    (``module``: the multi-task model, whose ``bert.config`` gives the encoder's shape; ``tokens``: tokens of a
    micro-batch, all rows full length; ``row_bytes``: 4 for fp32 rows, 2 for bf16)."""

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
    """``fastpals memory``'s ``auto`` per device: ``{name: {"mode", "why"}}`` from :func:`choose_memory_mode`
    with the traced buffer-mode peak and each device's usable bytes (``devices``). ``bert``: the encoder's
    config (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``); ``rows_dtype``: the rows' dtype
    (``fp32``/``bf16``); ``buffer_dtype``: the ``--surgery-buffer-dtype`` option (``bf16`` asked for: the buffer)."""
    if buffer_dtype == "bf16":
        return {n: {"mode": "buffer", "why": "bf16 rows asked for"} for n in devices}
    activations = estimate_activation_bytes(
        tokens, length, bert.hidden_size, bert.num_hidden_layers, bert.num_attention_heads, precision
    )
    rows = num_tasks * shared_elements * (2 if rows_dtype == "bf16" else 4)
    out = {}
    for name, usable in devices.items():
        choice = choose_memory_mode(rows, activations, buffer_peak_bytes, usable)
        out[name] = {"mode": choice.mode, "why": choice.why}
    return out
