"""Gradient surgery: per-task gradients of the shared parameters -> ``T x T`` Gram -> task weights -> one update.

An *aggregator* maps the Gram ``G[i, j] = <g_i, g_j>`` (float32/float64, on the device) to weights ``w [T]``;
the update is ``sum_t w_t g_t``. :data:`AGGREGATORS` names them all (``pcgrad``, ``gem``, ``upgrad``, ``mgda``,
``cagrad``, ``nashmtl``, ...: :mod:`.weights_basic`, :mod:`.weights_solved`, :mod:`.weights_extra`) and
:func:`make_weighting` builds one from string options. No aggregator reads the device from the host.

The per-task gradients live in one of two memory modes, both :class:`TaskGradients` (:mod:`.core`), whose
``apply`` runs Gram -> weights -> combine: :class:`TaskGradientBuffer` holds ``[T, P]`` rows (one backward per
task and :meth:`~TaskGradientBuffer.capture`, or :func:`per_task_gradients` from one backward);
:class:`StreamingTaskGradients` builds the Gram layer by layer in the one backward, memory flat in ``T``.
:class:`SurgeryOptimizer` (and its names :class:`PCGrad`, :class:`GEM`) wraps an optimizer with
Pytorch-PCGrad's ``pc_backward(losses)`` convention.

Mixed precision: use one loss scale for all tasks (the weights do not depend on it; the Gram is accumulated in
float32). Inf/nan in any task gradient skips the step: ``apply`` returns ``SurgeryResult(skipped=True, ...)``
and writes nothing; with ``torch.amp.GradScaler`` do not call ``scaler.step`` then, lower the scale yourself.

Data parallel: run the per-task backwards without DDP's all-reduce (``model.no_sync()``) and pass
``all_reduce=True`` (or ``process_group``): the task gradients are averaged before the Gram (per-rank Grams do
not add up to the global one), so every rank computes the same update. DeepSpeed ZeRO 0-2 (not 3): one
``engine.backward(loss_t)`` and ``buf.capture(t)`` per task, then ``buf.apply(...)`` and ``engine.step()``, with
``capture_task_params=True`` (ZeRO-1/2 backwards replace gradients) and DeepSpeed's getter and setter::

    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad
    buf = TaskGradientBuffer(shared, T, task_params=specific, capture_task_params=True,
                             grad_getter=safe_get_full_grad,
                             grad_setter=lambda p, g: safe_set_full_grad(
                                 p, g if g is not None else torch.zeros_like(p, dtype=torch.float32)))

DeepSpeed already averages each backward over the ranks: do not pass ``all_reduce``. Client optimizers need
``"zero_allow_untested_optimizer": true``; ``"gradient_clipping"`` applies after surgery.
"""

from fastpals.surgery.buffer import TaskGradientBuffer, parameters_reached
from fastpals.surgery.core import SurgeryResult, TaskGradients, default_grad_getter, default_grad_setter
from fastpals.surgery.optimizer_wrappers import GEM, PCGrad, SurgeryOptimizer, shared_parameters_by_name
from fastpals.surgery.options import make_weighting, parse_surgery_options
from fastpals.surgery.per_task import (
    PerTaskGradients,
    cu_seqlens_from_mask,
    per_task_gradients,
    task_mean_loss,
)
from fastpals.surgery.stream import StreamingTaskGradients
from fastpals.surgery.weights_basic import (
    gem_weights,
    mean_weights,
    pcgrad_orders,
    pcgrad_weights,
    sum_weights,
)
from fastpals.surgery.weights_extra import (
    ExcessMTLState,
    MoDoState,
    PCDState,
    SDMGradState,
    constant_weights,
    excessmtl_weights,
    krum_weights,
    modo_weights,
    pcd_weights,
    random_weights,
    sdmgrad_weights,
)
from fastpals.surgery.weights_solved import (
    AGGREGATORS,
    STATEFUL,
    CRMOGMState,
    GradVacState,
    NashMTLState,
    alignedmtl_weights,
    cagrad_weights,
    crmogm_weights,
    dualproj_weights,
    fairgrad_weights,
    gradvac_weights,
    imtlg_weights,
    mgda_weights,
    nashmtl_weights,
    upgrad_weights,
)

__all__ = [
    "AGGREGATORS",
    "GEM",
    "STATEFUL",
    "CRMOGMState",
    "ExcessMTLState",
    "GradVacState",
    "MoDoState",
    "NashMTLState",
    "PCDState",
    "SDMGradState",
    "SurgeryOptimizer",
    "alignedmtl_weights",
    "cagrad_weights",
    "constant_weights",
    "crmogm_weights",
    "dualproj_weights",
    "excessmtl_weights",
    "fairgrad_weights",
    "gradvac_weights",
    "imtlg_weights",
    "krum_weights",
    "make_weighting",
    "mgda_weights",
    "modo_weights",
    "nashmtl_weights",
    "parse_surgery_options",
    "pcd_weights",
    "random_weights",
    "sdmgrad_weights",
    "upgrad_weights",
    "PCGrad",
    "PerTaskGradients",
    "StreamingTaskGradients",
    "SurgeryResult",
    "TaskGradientBuffer",
    "TaskGradients",
    "cu_seqlens_from_mask",
    "default_grad_getter",
    "default_grad_setter",
    "gem_weights",
    "mean_weights",
    "parameters_reached",
    "per_task_gradients",
    "pcgrad_orders",
    "pcgrad_weights",
    "shared_parameters_by_name",
    "sum_weights",
    "task_mean_loss",
]
