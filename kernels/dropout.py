"""The dropout op: inverted dropout, and dropout of a branch added to its residual (``dropout(x) + residual``,
BERT's sublayer output before its LayerNorm). On CPU the keep mask comes from 16-bit slices of 64-bit random
words (:func:`dropout_reference` defines it), computed in one pass by the compiled kernel of ``csrc/dropout.cpp``
where it builds (bit-identical to the reference, forward and backward); elsewhere and under ``torch.compile``
``F.dropout``."""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from fastpals_kernels import extension

__all__ = ["Dropout", "compiled_dropout", "dropout", "dropout_add", "dropout_reference", "mask_words"]

_state: dict[str, bool] = {}


def compiled_dropout() -> bool:
    """Whether the compiled CPU kernel is there (built or loaded once per process; ``FASTPALS_DROPOUT=torch``
    turns it off)."""
    if "ok" not in _state:
        ok = os.environ.get("FASTPALS_DROPOUT", "").lower() != "torch"
        if ok and not hasattr(torch.ops.fastpals, "dropout_mask"):
            try:
                extension.build("fastpals_dropout", ("dropout.cpp",), cflags=("-O3", "-ffp-contract=off"))
            except (
                Exception
            ) as exc:  # no compiler, no ninja, no csrc/: the reference runs, with the same results
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                print(
                    f"fastpals: dropout runs as PyTorch ops (no compiled kernel: {reason})", file=sys.stderr
                )
                ok = False
        _state["ok"] = ok
    return _state["ok"]


def _check_p(p: float) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: p must be in [0, 1), got {p}")


def mask_words(n: int, p: float, compiled: bool = False) -> tuple[torch.Tensor, int, float]:
    """The random words of ``n`` elements (drawn from the CPU generator; ``compiled``: by the kernel's bulk copy
    of ``random_``, the same words), the keep threshold of a slice and the scale: ``p`` rounded to a multiple of
    1/65536, a slice below ``-32768 + 65536 p`` dropped."""
    drop = round(p * 65536)
    if compiled:
        words = torch.ops.fastpals.dropout_words((n + 3) // 4)
    else:
        words = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
    return words, drop - 32768, 65536.0 / (65536 - drop)


def dropout_reference(x: torch.Tensor, p: float) -> torch.Tensor:
    """The CPU dropout in PyTorch ops: ``(x * keep) * (1 / (1 - p))``, ``keep`` from the int16 slices of
    ``ceil(n / 4)`` random int64 words, each product rounded to ``x``'s dtype."""
    words, threshold, scale = mask_words(x.numel(), p)
    keep = words.view(torch.int16)[: x.numel()].view(x.shape) >= threshold
    return (x * keep).mul_(scale)  # the scale in the op's fp32 math: one rounding, as F.dropout


class _DropoutMask(torch.autograd.Function):
    """The compiled kernel with its gradient: the same mask on the incoming gradient, the residual's passed on."""

    @staticmethod
    def forward(ctx, x, words, threshold, scale, residual):  # noqa: ANN001, ANN205 - autograd's hooks
        ctx.save_for_backward(words)
        ctx.threshold, ctx.scale = threshold, scale
        return torch.ops.fastpals.dropout_mask(x, words, threshold, scale, True, residual)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        (words,) = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.ops.fastpals.dropout_mask(grad, words, ctx.threshold, ctx.scale, False, None)
        return dx, None, None, None, grad if ctx.needs_input_grad[4] else None


def dropout_add(
    x: torch.Tensor, residual: torch.Tensor | None, p: float, training: bool = True
) -> torch.Tensor:
    """``dropout(x, p, training) + residual`` (``residual`` None: the dropout alone), one pass on CPU where the
    compiled kernel is there. Any shape and floating dtype; ``residual`` of ``x``'s shape."""
    _check_p(p)
    if not training or p == 0.0:
        return x if residual is None else x + residual
    fused = (
        x.device.type == "cpu"
        and type(x) is torch.Tensor  # not a fake or traced tensor, no dispatch mode: they run the reference
        and not torch._C._len_torch_dispatch_stack()
        and not torch.compiler.is_compiling()
        and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))
        and compiled_dropout()
    )
    if fused:
        return _DropoutMask.apply(x, *mask_words(x.numel(), p, compiled=True), residual)
    if x.device.type != "cpu" or torch.compiler.is_compiling():  # the compiler traces F.dropout's mask
        y = F.dropout(x, p=p, training=True)
    else:
        y = dropout_reference(x, p)
    return y if residual is None else y + residual


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Inverted dropout (identity when ``training`` is False or ``p == 0``). On CPU ``p`` is rounded to a multiple
    of 1/65536 and the scale uses the rounded value (:func:`dropout_reference`)."""
    return dropout_add(x, None, p, training)


class Dropout(torch.nn.Dropout):
    """``nn.Dropout`` computed by :func:`dropout` (the same module type, state and ``p``; a faster mask on CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)
