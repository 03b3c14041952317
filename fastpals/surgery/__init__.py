"""Gradient surgery: per-task gradients of the shared parameters -> ``T x T`` Gram -> task weights -> one update.

An *aggregator* maps the Gram to weights ``w [T]`` (:data:`AGGREGATORS`, :func:`make_weighting`); the per-task
gradients live in a :class:`TaskGradientBuffer` (``[T, P]`` rows) or a :class:`StreamingTaskGradients` (the Gram
built layer by layer), whose ``apply`` runs Gram -> weights -> combine. :class:`SurgeryOptimizer` (and its names
:class:`PCGrad`, :class:`GEM`) wraps an optimizer. Mixed precision, data parallel and DeepSpeed: ``docs/api.md``.
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
