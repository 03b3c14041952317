"""Which backend runs each fastpals op: the Triton kernels, a stock PyTorch composition, or the reference.

One decision per op, from the device's compute capability and the dtype (:func:`decide`), under the override
``$FASTPALS_KERNELS`` = ``auto`` (default) | ``triton`` | ``reference`` (:func:`backend`). ``python -m
fastpals.env`` prints the decision and its reason for the current device. Backends:

- ``triton``: the fused kernels of this package (``fastpals_kernels.*_triton``);
- ``sdpa``: grouped cuBLAS matmuls plus ``F.scaled_dot_product_attention`` with the head dim padded to a
  multiple of 8 (:func:`fastpals.functional.attention_sdpa`), for GPUs where Triton emits no tensor-core code;
- ``flash_attn``: flash-attn's varlen kernel (BERT's own self-attention over packed rows);
- ``reference``: the plain PyTorch definitions in :mod:`fastpals.functional` (CPU, or forced).

Nothing here imports Triton at module load.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import NamedTuple

import torch

from fastpals import functional
from fastpals_kernels.common import interpret_mode

__all__ = [
    "KERNELS_ENV",
    "OPS",
    "Decision",
    "available",
    "backend",
    "capability_of",
    "combine",
    "decide",
    "flash_attn_installed",
    "flash_varlen_ok",
    "gram",
    "kernel_mode",
    "run_pal",
    "use_triton",
]

KERNELS_ENV = "FASTPALS_KERNELS"
_MODES = ("auto", "triton", "reference")

#: every op the dispatch decides, with what it is
OPS = {
    "pal": "fused PAL (V^E, per-task QKV, attention, V^D + GELU + residual)",
    "grouped_linear": "grouped-by-task linear layer",
    "pal_attention": "attention of the PAL's projected space (head dims 17/34/46)",
    "gram": "Gram matrix of the [T, P] task-gradient buffer",
    "combine": "weighted sum of the buffer's rows",
    "bert_attention_varlen": "BERT self-attention over packed rows",
}
_TENSOR_CORE_OPS = ("pal", "grouped_linear", "pal_attention")
_SM75_REASON = (
    "sm_{cap}: Triton >= 3.3 emits no mma for this GPU, so the fused kernels' 16-bit dots would run on CUDA "
    "cores and spill up to 2.9 KB per thread (AOT test); cuBLAS and SDPA use its tensor cores"
)
_SM75_FP32_REASON = "sm_{cap} fp32: no tensor cores on either path; the stock ops are kept as for 16-bit (GPU speed not measured)"


class Decision(NamedTuple):
    backend: str  # "triton" | "sdpa" | "flash_attn" | "reference"
    reason: str


def decide(
    op: str,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    flash_attn: bool = False,
) -> Decision:
    """The backend for ``op`` on a device of compute ``capability`` (``None`` = CPU) with ``dtype`` operands.

    ``flash_attn``: whether flash-attn is installed (only ``bert_attention_varlen`` reads it). The rules follow
    what the ahead-of-time compile test (tests/test_aot.py) shows for each target; speed on a GPU is not yet
    measured (a GPU run of bench/gpu_session.py does that), so the reasons say which evidence they rest on.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    half = dtype != torch.float32
    if op == "bert_attention_varlen":
        if capability is None:
            return Decision("sdpa", "CPU: padded scaled_dot_product_attention")
        if not flash_attn:
            return Decision("sdpa", "flash-attn is not installed: padded scaled_dot_product_attention")
        if capability < (8, 0):
            return Decision("sdpa", f"sm_{capability[0]}{capability[1]}: flash-attn 2 needs sm_80 or newer")
        if not half:
            return Decision("sdpa", "fp32: flash-attn runs fp16/bf16 only")
        return Decision("flash_attn", "flash-attn varlen kernel: packed rows, no padding work")
    if capability is None:
        return Decision("reference", "CPU: the PyTorch reference ops")
    cap = f"{capability[0]}{capability[1]}"
    if op in ("gram", "combine"):
        if capability < (7, 0):
            return Decision("reference", f"sm_{cap}: older than the GPUs Triton supports")
        return Decision("triton", "memory-bound single pass over the buffer (no tensor cores needed)")
    if capability < (8, 0):
        if dtype == torch.bfloat16:
            return Decision("reference", f"sm_{cap}: no bf16 tensor cores; the PyTorch reference ops")
        reason = (_SM75_REASON if half else _SM75_FP32_REASON).format(cap=cap)
        if op == "grouped_linear":
            return Decision("reference", reason + " (per-task cuBLAS matmuls)")
        return Decision("sdpa", reason)
    if half:
        return Decision(
            "triton",
            f"sm_{cap}: fused kernels compile to tensor-core mma with no spills (AOT test); GPU speed not yet "
            "measured",
        )
    return Decision(
        "triton",
        f"sm_{cap} fp32: IEEE fp32 products on both paths (no TF32, no tensor cores); the fused kernels save "
        "launches and never hold the L x L matrix; GPU speed not yet measured",
    )


def capability_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of ``tensor``'s CUDA device, or None for a CPU (or other) tensor."""
    if not tensor.is_cuda:
        return None
    return torch.cuda.get_device_capability(tensor.device)


@functools.lru_cache(maxsize=1)
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising something else at import
        return f"{type(exc).__name__}: {exc}"
    return None


def _kernels_compiled_for_gpu() -> bool:
    """True when the grouped kernels were already defined as GPU (non-interpreted) Triton functions."""
    module = sys.modules.get("fastpals_kernels.grouped_linear_triton")
    kernel = getattr(module, "_grouped_mm_kernel", None)
    return kernel is not None and type(kernel).__name__ != "InterpretedFunction"


def available() -> tuple[bool, str]:
    """Can the Triton kernels run here? Returns ``(ok, reason)``.

    ``ok`` is true when Triton imports and either a CUDA device is present or ``TRITON_INTERPRET=1`` is set
    (Triton's CPU interpreter, slow, meant for tests). ``reason`` says what is missing, or what will be used.
    """
    err = _triton_import_error()
    if err is not None:
        return False, f"triton is not importable ({err})"
    if torch.cuda.is_available():
        return True, f"triton on CUDA device {torch.cuda.get_device_name()}"
    if interpret_mode():
        return True, "triton interpreter (TRITON_INTERPRET=1, CPU tensors)"
    return False, "no CUDA device and TRITON_INTERPRET is not 1"


def kernel_mode() -> str:
    """The value of ``$FASTPALS_KERNELS``: ``auto`` (default), ``triton`` or ``reference``."""
    mode = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{KERNELS_ENV}={mode!r} is not one of {', '.join(_MODES)}")
    return mode


def use_triton(tensor: torch.Tensor) -> bool:
    """May the Triton kernels run on ``tensor`` under ``$FASTPALS_KERNELS``?

    ``reference`` -> False; ``auto`` (default) -> True when ``tensor`` is on CUDA and :func:`available` is true
    (:func:`backend` then asks :func:`decide` whether they should); ``triton`` -> True, raising
    ``RuntimeError`` when the kernels cannot run on ``tensor`` (no Triton; or a CPU tensor without
    ``TRITON_INTERPRET=1``, which must be set before Triton is first imported).
    """
    mode = kernel_mode()
    if mode == "reference":
        return False
    ok, reason = available()
    if mode == "auto":
        return tensor.is_cuda and ok
    if not ok:
        raise RuntimeError(f"{KERNELS_ENV}=triton but the Triton kernels cannot run: {reason}")
    if tensor.is_cuda:
        return True
    if tensor.device.type == "cpu" and interpret_mode():
        if _kernels_compiled_for_gpu():
            raise RuntimeError(
                f"{KERNELS_ENV}=triton on a CPU tensor: the kernels were loaded before TRITON_INTERPRET=1 was set "
                "(Triton fixes the mode when a kernel is defined); set it before importing fastpals_kernels ops"
            )
        return True
    raise RuntimeError(
        f"{KERNELS_ENV}=triton but the tensor is on {tensor.device}: the kernels need a CUDA tensor, or a CPU "
        "tensor with TRITON_INTERPRET=1 set before Triton is imported"
    )


def backend(op: str, tensor: torch.Tensor) -> str:
    """The backend that runs ``op`` on ``tensor`` now: ``reference`` mode -> reference; ``triton`` mode -> triton
    (or an error, see :func:`use_triton`); ``auto`` -> :func:`decide` for ``tensor``'s device and dtype, the
    reference wherever the Triton kernels cannot run."""
    if op == "bert_attention_varlen":
        dtype = tensor.dtype if tensor.dtype in (torch.float16, torch.bfloat16) else torch.float32
        return decide(op, capability_of(tensor), dtype, flash_attn_installed()).backend
    if not use_triton(tensor):
        return "reference"
    if kernel_mode() == "triton":
        return "triton"
    dtype = tensor.dtype if tensor.dtype in (torch.float16, torch.bfloat16) else torch.float32
    return decide(op, capability_of(tensor), dtype).backend


@functools.cache
def flash_attn_installed() -> bool:
    """flash-attn is importable (looked up, not imported)."""
    return importlib.util.find_spec("flash_attn") is not None


def flash_varlen_ok(q: torch.Tensor) -> bool:
    """flash-attn's varlen kernel serves BERT's packed attention on ``q``: installed, CUDA sm_80+, fp16/bf16."""
    return q.is_cuda and backend("bert_attention_varlen", q) == "flash_attn"


# ----------------------------------------------------------------------------------------------------------------
# Dispatching ops
# ----------------------------------------------------------------------------------------------------------------
def gram(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gram matrix of the rows of ``buf`` and a per-row finite flag, in one pass.

    Args:
        buf: ``[T, P]`` float32/float16/bfloat16, contiguous along P, ``T <= MAX_TASKS`` (32).

    Returns:
        ``(gram [T, T] float32, finite [T] bool)`` on ``buf``'s device (launched there). No host sync.
    """
    buf = functional.check_task_buffer(buf)
    if backend("gram", buf) == "triton":
        from fastpals_kernels.gram_triton import gram_triton

        return gram_triton(buf)
    return functional.gram_reference(buf)


def combine(
    buf: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None = None, *, out_row: int | None = None
) -> torch.Tensor:
    """``out = weights @ buf`` in one pass.

    Args:
        buf: ``[T, P]`` float32/float16/bfloat16, contiguous along P, ``T <= 32``.
        weights: ``[T]`` float32/float64 on ``buf``'s device (read as fp32).
        out: ``[P]`` contiguous float32/float16/bfloat16 destination (e.g. the flat gradient of the shared
            parameters); a new float32 tensor when omitted. It must not overlap ``buf``.
        out_row: instead of ``out``, write the result over row ``out_row`` of ``buf`` (no extra ``[P]`` memory;
            each column is read in full before it is written).

    Returns:
        ``out``.
    """
    buf = functional.check_task_buffer(buf)
    out, in_place = functional.check_combine_args(buf, weights, out, out_row)
    if backend("combine", buf) == "triton":
        from fastpals_kernels.combine_triton import combine_triton

        return combine_triton(buf, weights, out)
    return functional.combine_reference(buf, weights, out, in_place=in_place)


def run_pal(
    h: torch.Tensor,
    args: tuple,
    *,
    mask: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int = 0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + PAL(h)`` (just ``PAL(h)`` without a residual) on the backend :func:`backend` picks.

    h: ``[B, L, d]`` with ``mask [B, L]``, or packed rows ``[N, d]`` with ``cu_seqlens [B+1]`` and
    ``max_seqlen`` (computed once per forward by the caller); args: ``(task_ids, enc_weight, enc_bias,
    qkv_weight, qkv_bias, dec_weight, dec_bias, num_heads, gelu, dropout_p)`` as in
    :func:`fastpals.functional.pal_reference`. The Triton kernel adds the residual in its epilogue.
    """
    choice = backend("pal", h)
    if choice == "triton":
        import fastpals_kernels as kernels

        if cu_seqlens is not None:
            return kernels.pal_varlen(h, cu_seqlens, max_seqlen, *args, residual=residual)
        return kernels.pal(h, mask, *args, residual=residual)
    attention = "sdpa" if choice == "sdpa" else "reference"
    if cu_seqlens is not None:
        ts = functional.pal_varlen_reference(h, cu_seqlens, max_seqlen, *args, attention=attention)
    else:
        ts = functional.pal_reference(h, mask, *args, attention=attention)
    return ts if residual is None else residual + ts
