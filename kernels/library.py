# ruff: noqa: ANN001, ANN202 - fake implementations and autograd hooks mirror the ops' schemas
"""fastpals' ops as ``torch.library`` custom ops: ``torch.ops.fastpals.<name>``.

Each op has a schema, a fake (meta) implementation, an autograd formula where it is differentiable, a default
implementation (the reference of :mod:`fastpals_kernels.reference`; what runs on the CPU) and a CUDA one (the
Triton kernel, flash-attn or SDPA, as :func:`fastpals_kernels.dispatch.backend` decides for the tensors at hand).
``torch.compile``, ``torch.export``, fake tensors and ``torch.library.opcheck`` see them as single ops.

=====================  ======================================================================================
op                     computes
=====================  ======================================================================================
``pal``                ``residual + PAL(h)`` over a padded mixed-task batch ``h [B, L, d]``
``pal_varlen``         the same over packed rows ``h [N, d]`` with ``cu_seqlens [B+1]``
``pal_backward``       the gradients of ``pal`` (h and the six weights), recomputing its forward
``pal_varlen_backward``  the same for ``pal_varlen``
``attention_varlen``   softmax attention over packed rows ``q, k, v [N, H, Dh]`` (each sequence its own keys)
``attention_varlen_backward``  its gradients (q, k, v), recomputing the forward
``grouped_wgrad``      per-task weight (and bias) gradients ``dW_t = dY_tᵀ X_t`` from one backward's rows
=====================  ======================================================================================

Dropout inside ``pal*`` and ``attention_varlen`` draws its mask from ``seed`` (an int64 tensor of one element,
on the CPU: what the caller draws from torch's default generator), so a backward that recomputes the forward
sees the same mask. The backward ops recompute the forward (one extra forward of the PAL or the attention, not
of the encoder), as activation checkpointing does; the eager training path of :mod:`fastpals_kernels.dispatch`
keeps the Triton ops' saved activations instead.

Under ``torch.func.vmap`` (TorchJD's Jacobians) every non-mutating op runs once per sample
(:func:`~fastpals_kernels.common.per_sample_vmap`), so the ops, their autograd formulas included, work inside vmapped code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastpals_kernels import backends, eager
from fastpals_kernels.attention_varlen import attention_varlen_backward_op, attention_varlen_op
from fastpals_kernels.combine import combine_op, combine_out_op, combine_row_op
from fastpals_kernels.common import autograd_vjp, draw_seed, per_sample_vmap, seeded
from fastpals_kernels.gram import gram_op
from fastpals_kernels.grouped_linear import grouped_wgrad_op, grouped_wgrad_out_op

__all__ = ["NAMESPACE", "OPS", "draw_seed"]

NAMESPACE = "fastpals"
Tensor = torch.Tensor


def _backend(op: str, t: Tensor) -> str:
    return backends.backend(op, t)


# ----------------------------------------------------------------------------------------------------------------
# PAL
# ----------------------------------------------------------------------------------------------------------------
def _pal_eager(
    h: Tensor,
    where: dict,
    task_ids: Tensor,
    weights: Sequence[Tensor],
    num_heads: int,
    gelu: bool,
    dropout_p: float,
    residual: Tensor | None,
    seed: Tensor,
) -> Tensor:
    """``residual + PAL(h)`` on the backend the dispatch picks for ``h`` (differentiable where its inputs are),
    its dropout drawn from ``seed``."""
    args = (task_ids, *weights, num_heads, gelu, dropout_p)
    generator_seed = int(seed.reshape(-1)[0]) if dropout_p > 0.0 else None
    with seeded(seed, h.device, dropout_p):
        return eager.pal_eager(h, args, mask=where.get("mask"), cu_seqlens=where.get("cu_seqlens"),
                                  max_seqlen=where.get("max_seqlen", 0), residual=residual,
                                  generator_seed=generator_seed)  # fmt: skip


def _pal_grads(
    grad: Tensor,
    h: Tensor,
    where: dict,
    task_ids: Tensor,
    weights: Sequence[Tensor],
    num_heads: int,
    gelu: bool,
    dropout_p: float,
    seed: Tensor,
) -> list[Tensor]:
    """Gradients of ``PAL(h)`` in h and the six weights, by recomputing the forward with autograd."""

    def forward(*inputs: Tensor) -> Tensor:
        return _pal_eager(inputs[0], where, task_ids, inputs[1:], num_heads, gelu, dropout_p, None, seed)

    return list(autograd_vjp(forward, (h, *weights), grad))


@torch.library.custom_op(f"{NAMESPACE}::pal", mutates_args=())
def pal(
    h: Tensor,
    mask: Tensor | None,
    task_ids: Tensor,
    enc_weight: Tensor,
    enc_bias: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    dec_weight: Tensor,
    dec_bias: Tensor,
    num_heads: int,
    gelu: bool,
    dropout_p: float,
    residual: Tensor | None,
    seed: Tensor,
) -> Tensor:
    """``residual + PAL(h)``: h ``[B, L, d]``, mask ``[B, L]`` (1 = token) or None, task_ids ``[B]`` int64,
    weights as in :mod:`fastpals_kernels.reference`; returns ``[B, L, d]`` in h's dtype."""
    weights = (enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias)
    with torch.no_grad():
        out = _pal_eager(h, {"mask": mask}, task_ids, weights, num_heads, gelu, dropout_p, residual, seed)
    return out.clone() if out is h or out is residual else out


@torch.library.custom_op(f"{NAMESPACE}::pal_varlen", mutates_args=())
def pal_varlen(
    h: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    task_ids: Tensor,
    enc_weight: Tensor,
    enc_bias: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    dec_weight: Tensor,
    dec_bias: Tensor,
    num_heads: int,
    gelu: bool,
    dropout_p: float,
    residual: Tensor | None,
    seed: Tensor,
) -> Tensor:
    """Packed form of :func:`pal`: h ``[N, d]``, cu_seqlens ``[B+1]`` int32/int64, max_seqlen >= the longest
    sequence, task_ids ``[B]``; returns ``[N, d]``."""
    weights = (enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias)
    where = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
    with torch.no_grad():
        out = _pal_eager(h, where, task_ids, weights, num_heads, gelu, dropout_p, residual, seed)
    return out.clone() if out is h or out is residual else out


@torch.library.custom_op(f"{NAMESPACE}::pal_backward", mutates_args=())
def pal_backward(
    grad: Tensor,
    h: Tensor,
    mask: Tensor | None,
    task_ids: Tensor,
    enc_weight: Tensor,
    enc_bias: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    dec_weight: Tensor,
    dec_bias: Tensor,
    num_heads: int,
    gelu: bool,
    dropout_p: float,
    seed: Tensor,
) -> list[Tensor]:
    """``[dh, d enc_weight, d enc_bias, d qkv_weight, d qkv_bias, d dec_weight, d dec_bias]`` of :func:`pal`."""
    weights = (enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias)
    return _pal_grads(grad, h, {"mask": mask}, task_ids, weights, num_heads, gelu, dropout_p, seed)


@torch.library.custom_op(f"{NAMESPACE}::pal_varlen_backward", mutates_args=())
def pal_varlen_backward(
    grad: Tensor,
    h: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    task_ids: Tensor,
    enc_weight: Tensor,
    enc_bias: Tensor,
    qkv_weight: Tensor,
    qkv_bias: Tensor,
    dec_weight: Tensor,
    dec_bias: Tensor,
    num_heads: int,
    gelu: bool,
    dropout_p: float,
    seed: Tensor,
) -> list[Tensor]:
    """The gradients of :func:`pal_varlen`, as :func:`pal_backward`."""
    weights = (enc_weight, enc_bias, qkv_weight, qkv_bias, dec_weight, dec_bias)
    where = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
    return _pal_grads(grad, h, where, task_ids, weights, num_heads, gelu, dropout_p, seed)


def _pal_out_fake(h: Tensor, residual: Tensor | None) -> Tensor:
    dtype = h.dtype if residual is None else torch.promote_types(h.dtype, residual.dtype)
    return h.new_empty(h.shape, dtype=dtype)


@pal.register_fake
def _(h, mask, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu, dropout_p, residual, seed):
    return _pal_out_fake(h, residual)


@pal_varlen.register_fake
def _(h, cu, max_seqlen, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu, dropout_p, residual, seed):
    return _pal_out_fake(h, residual)


def _grads_fake(h: Tensor, *weights: Tensor) -> list[Tensor]:
    return [torch.empty_like(t) for t in (h, *weights)]


@pal_backward.register_fake
def _(grad, h, mask, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu, dropout_p, seed):
    return _grads_fake(h, ew, eb, qw, qb, dw, db)


@pal_varlen_backward.register_fake
def _(grad, h, cu, max_seqlen, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu, dropout_p, seed):
    return _grads_fake(h, ew, eb, qw, qb, dw, db)


def _pal_setup(ctx, inputs, output) -> None:
    """Tensors (and None) through ``save_for_backward``, the scalars as attributes."""
    ctx.save_for_backward(*[x if x is None or isinstance(x, Tensor) else None for x in inputs])
    ctx.scalars = [None if x is None or isinstance(x, Tensor) else x for x in inputs]


def _saved_inputs(ctx) -> list:
    return [s if t is None else t for t, s in zip(ctx.saved_tensors, ctx.scalars)]


def _pal_grad_outputs(ctx, grads: list[Tensor], residual: Tensor | None, grad: Tensor, lead: int) -> tuple:
    """The per-input gradient tuple: ``lead`` non-differentiable inputs after h, then the six weights."""
    out = [None] * len(ctx.scalars)
    out[0] = grads[0]
    for i, g in enumerate(grads[1:]):
        out[lead + 1 + i] = g
    if residual is not None:
        out[-2] = grad.to(residual.dtype)
    return tuple(out)


def _pal_backward_formula(ctx, grad: Tensor) -> tuple:
    h, mask, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu, dropout_p, residual, seed = _saved_inputs(ctx)
    grads = torch.ops.fastpals.pal_backward(grad, h, mask, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu,
                                            dropout_p, seed)  # fmt: skip
    return _pal_grad_outputs(ctx, grads, residual, grad, lead=2)


def _pal_varlen_backward_formula(ctx, grad: Tensor) -> tuple:
    h, cu, max_seqlen, task_ids, ew, eb, qw, qb, dw, db, num_heads, gelu, dropout_p, residual, seed = (
        _saved_inputs(ctx)
    )
    grads = torch.ops.fastpals.pal_varlen_backward(grad, h, cu, max_seqlen, task_ids, ew, eb, qw, qb, dw, db,
                                                   num_heads, gelu, dropout_p, seed)  # fmt: skip
    return _pal_grad_outputs(ctx, grads, residual, grad, lead=3)


pal.register_autograd(_pal_backward_formula, setup_context=_pal_setup)
pal_varlen.register_autograd(_pal_varlen_backward_formula, setup_context=_pal_setup)


#: every op of the library, by name (``torch.ops.fastpals.<name>``)
OPS = {
    op._name: op
    for op in (
        pal,
        pal_varlen,
        pal_backward,
        pal_varlen_backward,
        attention_varlen_op,
        attention_varlen_backward_op,
        grouped_wgrad_op,
        grouped_wgrad_out_op,
        gram_op,
        combine_op,
        combine_out_op,
        combine_row_op,
    )
}


#: the ops that take a vmap rule (the mutating ``grouped_wgrad_out`` / ``combine_out`` / ``combine_row`` write into
#: their arguments)
VMAPPED = ("pal", "pal_varlen", "pal_backward", "pal_varlen_backward")
for _name in VMAPPED:
    OPS[_name].register_vmap(per_sample_vmap(OPS[_name]))
