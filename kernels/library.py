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

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from fastpals_kernels import backends, eager
from fastpals_kernels.combine import combine_op, combine_out_op, combine_row_op
from fastpals_kernels.common import per_sample_vmap
from fastpals_kernels.gram import gram_op
from fastpals_kernels.grouped_linear import grouped_wgrad_op, grouped_wgrad_out_op

__all__ = ["NAMESPACE", "OPS", "draw_seed"]

NAMESPACE = "fastpals"
Tensor = torch.Tensor


def draw_seed() -> Tensor:
    """A dropout seed for the ops above: one int64 drawn from torch's default CPU generator (no device read)."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64)


@contextlib.contextmanager
def _seeded(seed: Tensor, device: torch.device, dropout_p: float) -> Iterator[None]:
    """Run the block with torch's generators (CPU, and ``device``'s when CUDA) seeded from ``seed``, restored
    afterwards; a no-op without dropout."""
    if dropout_p <= 0.0:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed(int(seed.reshape(-1)[0]))
        yield


def _vjp(fn: Callable[..., Tensor], inputs: Sequence[Tensor], grad: Tensor) -> tuple[Tensor, ...]:
    """The gradients of ``fn(*inputs)`` against ``grad``, recomputing ``fn`` with autograd. An op's kernel runs
    below the autograd dispatch key, so autograd is switched back on for the recomputation."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    with _autograd_on(), torch.enable_grad():
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    # outputs may not alias each other (e.g. the unbound views of one stacked gradient)
    return tuple(torch.zeros_like(x) if g is None else g.clone() if g._base is not None else g
                 for g, x in zip(grads, leaves))  # fmt: skip


@contextlib.contextmanager
def _autograd_on() -> Iterator[None]:
    """Autograd's dispatch keys switched back on (an op's kernel runs with them excluded)."""
    keys = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)
    with contextlib.ExitStack() as stack:
        for key in keys:
            stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(key, False))
        yield


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
    with _seeded(seed, h.device, dropout_p):
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

    return list(_vjp(forward, (h, *weights), grad))


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


# ----------------------------------------------------------------------------------------------------------------
# Attention over packed rows (BERT's self-attention)
# ----------------------------------------------------------------------------------------------------------------
def _attention_eager(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float, seed: Tensor
) -> Tensor:
    with _seeded(seed, q.device, dropout_p):
        return eager.attention_varlen_eager(q, k, v, cu_seqlens, max_seqlen, dropout_p)


@torch.library.custom_op(f"{NAMESPACE}::attention_varlen", mutates_args=())
def attention_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float, seed: Tensor
) -> Tensor:
    """Softmax attention over packed rows: q, k, v ``[N, H, Dh]``, cu_seqlens ``[B+1]``; each sequence attends
    to its own keys. Returns ``[N, H, Dh]`` in q's dtype (flash-attn varlen on CUDA sm_80+ fp16/bf16 where it is
    installed, SDPA elsewhere on CUDA, the reference on the CPU)."""
    with torch.no_grad():
        return _attention_eager(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed).contiguous()


@torch.library.custom_op(f"{NAMESPACE}::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float,
    seed: Tensor,
) -> list[Tensor]:
    """``[dq, dk, dv]`` of :func:`attention_varlen`, recomputing its forward."""

    def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return _attention_eager(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed)

    return list(_vjp(forward, (q, k, v), grad))


@attention_varlen.register_fake
def _(q, k, v, cu, max_seqlen, dropout_p, seed):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@attention_varlen_backward.register_fake
def _(grad, q, k, v, cu, max_seqlen, dropout_p, seed):
    return [torch.empty_like(t) for t in (q, k, v)]


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, cu, max_seqlen, dropout_p, seed = inputs
    ctx.save_for_backward(q, k, v, cu, seed)
    ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p


def _attention_backward_formula(ctx, grad: Tensor) -> tuple:
    q, k, v, cu, seed = ctx.saved_tensors
    dq, dk, dv = torch.ops.fastpals.attention_varlen_backward(
        grad, q, k, v, cu, ctx.max_seqlen, ctx.dropout_p, seed
    )
    return dq, dk, dv, None, None, None, None


attention_varlen.register_autograd(_attention_backward_formula, setup_context=_attention_setup)


#: every op of the library, by name (``torch.ops.fastpals.<name>``)
OPS = {
    op._name: op
    for op in (
        pal,
        pal_varlen,
        pal_backward,
        pal_varlen_backward,
        attention_varlen,
        attention_varlen_backward,
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
VMAPPED = ("pal", "pal_varlen", "pal_backward", "pal_varlen_backward", "attention_varlen",
           "attention_varlen_backward")  # fmt: skip
for _name in VMAPPED:
    OPS[_name].register_vmap(per_sample_vmap(OPS[_name]))
