"""Which backend runs each fastpals op: ``triton`` (this package's kernels), ``sdpa`` (cuBLAS matmuls and
``F.scaled_dot_product_attention``), ``flash_attn`` (BERT's packed attention) or ``reference`` (plain
PyTorch), decided per op from the device's compute capability and the dtype (:func:`decide`) under the switch
``$FASTPALS_KERNELS``: a mode ``auto`` (default) | ``triton`` | ``reference``, then optional ``op=backend``
overrides and the word ``library`` (every call through ``torch.ops.fastpals``), e.g. ``auto,gram=reference``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fastpals_kernels.common import TritonKernel, interpret_mode

__all__ = [
    "BACKENDS_ENV",
    "KERNELS_ENV",
    "OPS",
    "Switch",
    "OPS_ENV",
    "Backend",
    "Decision",
    "available",
    "backend",
    "capability_of",
    "decide",
    "flash_attn_installed",
    "flash_varlen_ok",
    "kernel_mode",
    "register_backend",
    "registered",
    "require_triton",
    "switch",
    "unregister_backend",
    "use_library",
    "use_triton",
]


KERNELS_ENV = "FASTPALS_KERNELS"
#: deprecated forms of the per-op overrides and of the flag ``library``: still read, with a warning
BACKENDS_ENV, OPS_ENV = "FASTPALS_BACKENDS", "FASTPALS_OPS"
_BUILTIN_BACKENDS = ("triton", "sdpa", "flash_attn", "reference")
_MODES = ("auto", "triton", "reference")

#: every op the dispatch decides, with what it is
OPS = {
    "pal": "fused PAL (V^E, per-task QKV, attention, V^D + GELU + residual)",
    "grouped_linear": "grouped-by-task linear layer",
    "grouped_wgrad": "per-task weight gradients of a Linear from one backward (grouped GEMM)",
    "pal_attention": "attention of the PAL's projected space (head dims 17/34/46)",
    "gram": "Gram matrix of the [T, P] task-gradient buffer",
    "combine": "weighted sum of the buffer's rows",
    "bert_attention_varlen": "BERT self-attention over packed rows",
    "dropout_layer_norm": "residual + dropout + LayerNorm of BERT's sublayer outputs",
}


class Decision(NamedTuple):
    backend: str  # "triton" | "sdpa" | "flash_attn" | "reference"
    reason: str


def decide(
    op: str, capability: tuple[int, int] | None, dtype: torch.dtype, flash_attn: bool = False
) -> Decision:
    """The backend for ``op`` on a device of compute ``capability`` (``None`` = CPU) with ``dtype`` operands, and
    the evidence it rests on (tests/test_aot.py per target). ``flash_attn``: flash-attn is installed."""
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    for registered in _REGISTERED.get(op, []):
        reason = registered.serves(capability, dtype)
        if reason:
            return Decision(registered.name, reason)
    if op == "grouped_wgrad":  # the same grouped GEMMs as the grouped linear's backward
        op = "grouped_linear"
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
    if op in ("gram", "combine", "dropout_layer_norm"):
        if capability < (7, 0):
            return Decision("reference", f"sm_{cap}: older than the GPUs Triton supports")
        return Decision("triton", "memory-bound single pass (no tensor cores needed)")
    if capability < (8, 0):
        if dtype == torch.bfloat16:
            return Decision("reference", f"sm_{cap}: no bf16 tensor cores; the PyTorch reference ops")
        reason = f"sm_{cap}: Triton emits no mma here (AOT test); cuBLAS and SDPA use its tensor cores"
        if not half:
            reason = f"sm_{cap} fp32: no tensor cores on either path; the stock ops as for 16-bit"
        if op == "grouped_linear":
            return Decision("reference", reason + " (per-task cuBLAS matmuls)")
        return Decision("sdpa", reason)
    if half:
        return Decision("triton", f"sm_{cap}: fused kernels compile to tensor-core mma (AOT test)")
    return Decision("triton", f"sm_{cap} fp32: IEEE fp32 products; the fused kernels save launches")


def capability_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of ``tensor``'s CUDA device, or None for a CPU (or other) tensor."""
    return torch.cuda.get_device_capability(tensor.device) if tensor.is_cuda else None


#: probes that cannot change while the process runs (a plain dict: ``torch.compile`` warns on ``functools`` caches)
_PROBES: dict[str, Any] = {}


def _triton_import_error() -> str | None:
    if "triton" not in _PROBES:
        _PROBES["triton"] = None
        try:
            import triton.language  # noqa: F401
        except Exception as exc:  # ImportError, or a broken install raising something else at import
            _PROBES["triton"] = f"{type(exc).__name__}: {exc}"
    return _PROBES["triton"]


def available() -> tuple[bool, str]:
    """``(ok, reason)``: the Triton kernels can run here (Triton imports, and a CUDA device or
    ``TRITON_INTERPRET=1``, the CPU interpreter for tests); ``reason`` says what is missing or what is used."""
    err = _triton_import_error()
    if err is not None:
        return False, f"triton is not importable ({err})"
    if torch.cuda.is_available():
        return True, f"triton on CUDA device {torch.cuda.get_device_name()}"
    if interpret_mode():
        return True, "triton interpreter (TRITON_INTERPRET=1, CPU tensors)"
    return False, "no CUDA device and TRITON_INTERPRET is not 1"


class Switch(NamedTuple):
    """``$FASTPALS_KERNELS`` parsed: the mode, the per-op backends it names, and the ``library`` flag."""

    mode: str
    forced: dict[str, str]
    library: bool


_WARNED: set[str] = set()


def switch() -> Switch:
    """``$FASTPALS_KERNELS`` parsed (plus the deprecated ``$FASTPALS_BACKENDS`` and ``$FASTPALS_OPS``); a one-line
    ``ValueError`` naming the variable when malformed."""
    modes, forced, library = [], {}, False
    for var in (BACKENDS_ENV, OPS_ENV, KERNELS_ENV):
        text = os.environ.get(var, "").strip()
        if text and var != KERNELS_ENV and var not in _WARNED:
            _WARNED.add(var)
            warnings.warn(
                f"{var} is deprecated and will be removed in the next release: put its items in {KERNELS_ENV} "
                f"instead (e.g. {KERNELS_ENV}=auto,pal=sdpa,library)",
                FutureWarning,
                stacklevel=3,
            )
        if var == OPS_ENV:
            if text.lower() not in ("", "auto", "library"):
                raise ValueError(f"{OPS_ENV}={text!r} is not one of auto, library")
            library = text.lower() == "library"
            continue
        for item in filter(None, (part.strip() for part in text.split(","))):
            op, sep, name = (part.strip() for part in item.partition("="))
            if not sep and op.lower() == "library":
                library = True
            elif not sep and op.lower() in _MODES:
                modes.append(op.lower())
            elif not sep:
                raise ValueError(
                    f"{var}={text!r}: {item!r} is not a mode ({', '.join(_MODES)}), op=backend or library"
                )
            elif op not in OPS or not name:
                raise ValueError(f"{var}={text!r}: in op=backend, op must be one of {', '.join(OPS)}")
            else:
                forced[op] = name
    if len(modes) > 1:
        raise ValueError(f"{KERNELS_ENV} names more than one mode ({', '.join(modes)}); keep one")
    return Switch(modes[0] if modes else "auto", forced, library)


def kernel_mode() -> str:
    """The mode of ``$FASTPALS_KERNELS``: ``auto`` (default), ``triton`` or ``reference``."""
    return switch().mode


def require_triton(name: str) -> None:
    """Raise a one-line ``ImportError`` when the Triton op ``name`` cannot run here (see :func:`available`)."""
    if _triton_import_error() is not None:
        raise ImportError(f"fastpals_kernels.{name} needs Triton ({available()[1]}); use the reference ops "
                          f"(fastpals.functional) or {KERNELS_ENV}=reference")  # fmt: skip


def use_triton(tensor: torch.Tensor) -> bool:
    """May the Triton kernels run on ``tensor`` under ``$FASTPALS_KERNELS``? ``reference``: no; ``auto``: on
    CUDA where :func:`available`; ``triton``: yes, or a ``RuntimeError`` when they cannot run on ``tensor``."""
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
        # the grouped kernels were already made as GPU (non-interpreted) Triton functions
        kernel = getattr(sys.modules.get("fastpals_kernels.grouped_linear"), "_grouped_mm_kernel", None)
        kernel = kernel.kernel if isinstance(kernel, TritonKernel) else kernel
        if kernel is not None and type(kernel).__name__ != "InterpretedFunction":
            raise RuntimeError(
                f"{KERNELS_ENV}=triton on a CPU tensor: the kernels were loaded before TRITON_INTERPRET=1 was set "
                "(Triton fixes the mode when a kernel is first launched); set it before the first launch"
            )
        return True
    raise RuntimeError(
        f"{KERNELS_ENV}=triton but the tensor is on {tensor.device}: the kernels need a CUDA tensor, or a CPU "
        "tensor with TRITON_INTERPRET=1 set before the first launch"
    )


def backend(op: str, tensor: torch.Tensor) -> str:
    """The backend that runs ``op`` on ``tensor`` now: an ``op=backend`` item of ``$FASTPALS_KERNELS``, else the
    mode's (``auto``: :func:`decide` for ``tensor``'s device and dtype where the kernels can run)."""
    forced = switch().forced.get(op)
    if forced is not None:
        if forced not in _BUILTIN_BACKENDS and registered(op, forced) is None:
            raise ValueError(f"{KERNELS_ENV}: {op}={forced} names no backend of {op}")
        if forced == "triton" and not tensor.is_cuda and not interpret_mode():
            raise RuntimeError(f"{KERNELS_ENV}: {op}=triton needs a CUDA tensor or TRITON_INTERPRET=1")
        return forced
    dtype = tensor.dtype if tensor.dtype in (torch.float16, torch.bfloat16) else torch.float32
    if op == "bert_attention_varlen":
        return decide(op, capability_of(tensor), dtype, flash_attn_installed()).backend
    if _REGISTERED.get(op) and kernel_mode() == "auto":
        choice = decide(op, capability_of(tensor), dtype).backend
        if registered(op, choice) is not None:
            return choice
    if not use_triton(tensor):
        return "reference"
    if kernel_mode() == "triton":
        return "triton"
    return decide(op, capability_of(tensor), dtype).backend


def flash_attn_installed() -> bool:
    """flash-attn is importable (looked up, not imported)."""
    if "flash_attn" not in _PROBES:
        try:
            _PROBES["flash_attn"] = importlib.util.find_spec("flash_attn") is not None
        except ValueError:  # imported already, without a spec: a stand-in module (not cached)
            return True
    return _PROBES["flash_attn"]


def flash_varlen_ok(q: torch.Tensor) -> bool:
    """flash-attn's varlen kernel serves BERT's packed attention on ``q``: installed, CUDA sm_80+, fp16/bf16."""
    return q.is_cuda and backend("bert_attention_varlen", q) == "flash_attn"


#: ``serves(capability, dtype)``: the reason a registered backend serves an op there, or None
Serves = Callable[[tuple[int, int] | None, torch.dtype], str | None]


class Backend(NamedTuple):
    """A backend added with :func:`register_backend`: ``serves(capability, dtype)`` gives the reason it serves the
    op there (None: it does not); ``impl`` takes and returns what the op's public function does."""

    name: str
    serves: Serves
    impl: Callable[..., Any]


_REGISTERED: dict[str, list[Backend]] = {}


def register_backend(op: str, name: str, serves: Serves, impl: Callable[..., Any]) -> None:
    """Add a backend for ``op``: asked before the built-in rules of :func:`decide`, newest first; it runs wherever
    ``serves`` gives a reason (and wherever ``$FASTPALS_KERNELS`` names it: ``op=name``)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if name in _BUILTIN_BACKENDS:
        raise ValueError(f"{name!r} is a built-in backend name; pick another")
    _REGISTERED[op] = [Backend(name, serves, impl), *(b for b in _REGISTERED.get(op, []) if b.name != name)]


def unregister_backend(op: str, name: str) -> None:
    """Remove a backend added with :func:`register_backend` (no error when absent)."""
    _REGISTERED[op] = [b for b in _REGISTERED.get(op, []) if b.name != name]


def registered(op: str, name: str) -> Backend | None:
    """The backend registered for ``op`` under ``name`` (:func:`register_backend`), or None."""
    return next((b for b in _REGISTERED.get(op, []) if b.name == name), None)


def use_library(choice: str, t: torch.Tensor) -> bool:
    """Does this call go through ``torch.ops.fastpals`` rather than the eager path? Under the ``library`` flag, and
    under ``torch.compile`` / fake tensors for every backend but the reference (which the compiler traces)."""
    if switch().library:
        return True
    return choice != "reference" and (torch.compiler.is_compiling() or isinstance(t, FakeTensor))
