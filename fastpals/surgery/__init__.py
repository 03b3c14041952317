"""Gradient surgery (PCGrad, GEM, UPGrad, MGDA, CAGrad, Nash-MTL, ...) as Gram -> task weights -> weighted sum.

Every method here is an *aggregator*: a function of the ``T x T`` Gram matrix ``G[i, j] = <g_i, g_j>`` of the
task gradients (over the parameters shared by the tasks) returning weights ``w [T]`` such that the update is
``sum_t w_t g_t``: :func:`sum_weights`, :func:`mean_weights`, :func:`pcgrad_weights`, :func:`gem_weights`.
The weights are computed on the device, without synchronising. :mod:`fastpals.surgery.weights_solved` adds UPGrad,
MGDA, DualProj, IMTL-G, CAGrad, Aligned-MTL, FairGrad, Nash-MTL, GradVac and CR-MOGM, and
:mod:`fastpals.surgery.weights_extra` Constant, Random, Krum, MoDo and SDMGrad; :data:`AGGREGATORS` maps every
lower-case name to its function, :func:`make_weighting` builds one from string options, and
:class:`SurgeryOptimizer` wraps an optimizer for any name.

:class:`TaskGradientBuffer` holds the per-task gradients of the shared parameters in one flat ``[T, P]`` tensor
(float32 or bfloat16), filled by one backward per task with the graph freed each time; ``apply`` runs the fused
Gram kernel (float32 accumulation, finite check fused), the aggregator, and the fused combine kernel that writes
the update into the parameters' ``.grad``. :class:`StreamingTaskGradients` is its streaming
counterpart for the one-backward capture (:func:`per_task_gradients`): the Gram accumulated layer by layer during
the backward and the update written by one weight-gradient GEMM per layer, memory flat in ``T``
(:mod:`fastpals.surgery.stream`). :class:`PCGrad` and :class:`GEM` wrap an optimizer with
Pytorch-PCGrad's ``pc_backward(losses)`` convention.

Mixed precision: use one loss scale for all tasks (the weights do not depend on it; the Gram is accumulated in
float32 so that ``S^2 |g|^2`` does not overflow). Inf/nan in any task gradient skips the step: ``apply`` returns
``SurgeryResult(skipped=True, nonfinite_tasks=[...])``, writes nothing, and the wrappers' ``step()`` does nothing.
With ``torch.amp.GradScaler``, do not call ``scaler.step`` on a skipped step (it finds no gradients); lower the
scale yourself, e.g. ``scaler.update(scaler.get_scale() * scaler.get_backoff_factor())``. Clip after surgery.

Data parallel: surgery must act on the global per-task gradients (per-rank Gram matrices do not add up to the
global one). Run the per-task backwards without DDP's gradient all-reduce (``model.no_sync()`` or no DDP
wrapper), then ``TaskGradientBuffer(..., all_reduce=True)`` (or ``process_group=pg``) averages the ``[T, P]``
buffer across ranks before the Gram: ``T * P`` elements per step (plain DDP reduces ``P``), plus the
task-specific gradients and ``T * n_params`` touched flags. Every rank then computes the same update.

DeepSpeed (ZeRO stage 0, 1, 2), measured with DeepSpeed 0.19.8 on its CPU accelerator (gloo, 1 and 2 ranks,
``tests/test_surgery_distributed.py``): one ``engine.backward(loss_t)`` per task followed by ``buf.capture(t)``,
then ``buf.apply(...)`` and ``engine.step()``, gives exactly the update of the plain-PyTorch buffer path on the
whole batch, for stages 0, 1 and 2 (no "Gradient computed twice for this partition" error arose with three
backwards per step). Build the buffer with::

    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad  # DeepSpeed's import takes seconds
    buf = TaskGradientBuffer(shared, T, task_params=specific, capture_task_params=True,
                             grad_getter=safe_get_full_grad,
                             grad_setter=lambda p, g: safe_set_full_grad(
                                 p, g if g is not None else torch.zeros_like(p, dtype=torch.float32)))

- DeepSpeed averages the gradients over the ranks inside each ``engine.backward``, so do not pass
  ``all_reduce`` (the communication is ``T`` gradient reductions per step, ``T * P`` elements, as with the
  buffer's own all-reduce).
- Under ZeRO-1/2 each backward *replaces* the reduced gradients instead of accumulating them (a task head
  trained by task 1 lost its gradient in task 2's backward), hence ``capture_task_params=True``, which takes the
  task-specific gradients out at each capture and writes them back in ``apply``.
- ``safe_get_full_grad`` / ``safe_set_full_grad`` must be called on every rank (the buffer does). With fp16 the
  values carry the loss scale: the weights do not depend on it. DeepSpeed 0.19.8 clips gradients at 1.0 by
  default; set ``"gradient_clipping"`` as you intend (it applies after surgery, in ``engine.step``).
- Client optimizers need ``"zero_allow_untested_optimizer": true`` under ZeRO. ZeRO-3 is not covered.
"""

from fastpals.surgery.buffer import (
    SurgeryResult,
    TaskGradientBuffer,
    default_grad_getter,
    default_grad_setter,
    parameters_reached,
)
from fastpals.surgery.optimizer_wrappers import GEM, PCGrad, SurgeryOptimizer, shared_parameters_by_name
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
    MoDoState,
    SDMGradState,
    constant_weights,
    krum_weights,
    modo_weights,
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
    make_weighting,
    mgda_weights,
    nashmtl_weights,
    parse_surgery_options,
    upgrad_weights,
)

__all__ = [
    "AGGREGATORS",
    "GEM",
    "STATEFUL",
    "CRMOGMState",
    "GradVacState",
    "MoDoState",
    "NashMTLState",
    "SDMGradState",
    "SurgeryOptimizer",
    "alignedmtl_weights",
    "cagrad_weights",
    "constant_weights",
    "crmogm_weights",
    "dualproj_weights",
    "fairgrad_weights",
    "gradvac_weights",
    "imtlg_weights",
    "krum_weights",
    "make_weighting",
    "mgda_weights",
    "modo_weights",
    "nashmtl_weights",
    "parse_surgery_options",
    "random_weights",
    "sdmgrad_weights",
    "upgrad_weights",
    "PCGrad",
    "PerTaskGradients",
    "StreamingTaskGradients",
    "SurgeryResult",
    "TaskGradientBuffer",
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
