"""``SurgeryOptimizer(optimizer, method=...)``: any aggregator around any optimizer, with Pytorch-PCGrad's
``pc_backward(losses)`` (one backward per loss, each captured into a buffer row); ``PCGrad`` and ``GEM``
too."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from fastpals.surgery.buffer import TaskGradientBuffer, parameters_reached
from fastpals.surgery.core import SurgeryResult
from fastpals.surgery.weights_basic import gem_weights, proposal_vector
from fastpals.surgery.weights_solved import make_weighting


def shared_parameters_by_name(
    model: torch.nn.Module, is_task_specific: Callable[[str], bool] | None = None
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Split ``model``'s trainable parameters into ``(shared, task_specific)`` by name (default:
    :class:`~fastpals.MultiTaskBert`'s, where heads, PAL weights and task embeddings are task-specific)."""
    if is_task_specific is None:
        from fastpals.encoder.bert import is_task_specific  # the parameter's default rule

    shared, specific = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (specific if is_task_specific(name) else shared).append(p)
    return shared, specific


class SurgeryOptimizer:
    """Any aggregator of :data:`fastpals.surgery.AGGREGATORS` around any optimizer:
    ``SurgeryOptimizer(opt, method="upgrad").backward(losses); opt.step()``.

    Args:
        generator: CPU ``torch.Generator`` for the random orders of ``pcgrad`` and ``gradvac``.
        buffer_dtype: dtype of the per-task gradient rows (float32, or bfloat16 to halve their memory).
        shared_params: the parameters shared by the tasks (default: those reached by two or more losses'
            graphs; give it where task-specific weights are slices of one parameter:
            :func:`shared_parameters_by_name`).
        buffer_kwargs: passed to :class:`TaskGradientBuffer` (``grad_getter``, ``process_group``, ...).
        **options: the method's options (strings are parsed, :func:`~fastpals.surgery.make_weighting`).

    Task-specific and unused parameters are left alone; ``state_dict()`` holds a stateful method's
    :attr:`weighting_state` under ``"surgery"``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        method: str = "pcgrad",
        generator: torch.Generator | None = None,
        buffer_dtype: torch.dtype = torch.float32,
        shared_params: Iterable[torch.nn.Parameter] | None = None,
        buffer_kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.method = str(method).lower()
        self.weighting, self.weighting_state = make_weighting(self.method, **options)
        self.generator = generator
        self.buffer_dtype = buffer_dtype
        self.shared_params = list(shared_params) if shared_params is not None else None
        self.buffer_kwargs = buffer_kwargs or {}
        self.buffer: TaskGradientBuffer | None = None
        self.last_result: SurgeryResult | None = None
        self.skipped_steps = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        out = dict(self.optimizer.state_dict())
        if self.weighting_state is not None:
            out["surgery"] = self.weighting_state.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        surgery = state_dict.pop("surgery", None)
        self.optimizer.load_state_dict(state_dict)
        if self.weighting_state is not None and surgery is not None:
            self.weighting_state.load_state_dict(surgery)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the wrapped optimizer, unless the last surgery skipped the step (non-finite gradients)."""
        if self.last_result is not None and self.last_result.skipped:
            return None
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def _split(
        self, losses: Sequence[torch.Tensor]
    ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        groups = self.optimizer.param_groups
        params = list({id(p): p for g in groups for p in g["params"] if p.requires_grad}.values())
        if self.shared_params is not None:
            ids = {id(p) for p in self.shared_params}
            return list(self.shared_params), [p for p in params if id(p) not in ids]
        reached = [parameters_reached(loss, params) for loss in losses]
        counts = [sum(r[k] for r in reached) for k in range(len(params))]
        shared = [p for p, c in zip(params, counts) if c >= 2]
        specific = [p for p, c in zip(params, counts) if c == 1]
        if not shared:  # one task, or tasks sharing nothing: every weight is 1, surgery leaves the sum as is
            shared, specific = specific, []
        if not shared:
            raise ValueError("no optimizer parameter is reached by the losses' graphs")
        return shared, specific

    def _buffer_for(
        self, shared: list[torch.nn.Parameter], specific: list[torch.nn.Parameter], rows: int
    ) -> TaskGradientBuffer:
        buf = self.buffer
        key = (rows, [id(p) for p in shared], [id(p) for p in specific])
        if (
            buf is None
            or (buf.num_tasks, [id(p) for p in buf.params], [id(p) for p in buf.task_params]) != key
        ):
            buf = self.buffer = TaskGradientBuffer(
                shared, rows, self.buffer_dtype, task_params=specific, **self.buffer_kwargs
            )
        return buf

    @staticmethod
    def _check_losses(losses: Sequence[torch.Tensor], name: str) -> list[torch.Tensor]:
        if isinstance(losses, torch.Tensor) or not isinstance(losses, Sequence) or len(losses) == 0:
            raise TypeError(f"{name} must be a non-empty list of scalar loss tensors, one per task")
        for t, loss in enumerate(losses):
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"{name}[{t}] must be a scalar tensor")
            if not loss.requires_grad:
                raise ValueError(f"{name}[{t}] does not require grad")
        return list(losses)

    def _backward_into(self, buf: TaskGradientBuffer, losses: list[torch.Tensor], first_row: int) -> None:
        for t, loss in enumerate(losses):
            loss.backward(retain_graph=t < len(losses) - 1)
            buf.capture(first_row + t)

    def backward(self, losses: Sequence[torch.Tensor]) -> SurgeryResult:
        """Back-propagate each task loss into its buffer row and write the method's update into ``.grad``."""
        losses = self._check_losses(losses, "losses")
        shared, specific = self._split(losses)
        buf = self._buffer_for(shared, specific, len(losses))
        self.optimizer.zero_grad(set_to_none=True)
        self._backward_into(buf, losses, 0)
        return self._finish(buf.apply(self.weighting, generator=self.generator))

    pc_backward = backward

    def _finish(self, result: SurgeryResult) -> SurgeryResult:
        self.last_result = result
        if result.skipped:
            self.skipped_steps += 1
        return result


class PCGrad(SurgeryOptimizer):
    """``SurgeryOptimizer(optimizer, method="pcgrad", ...)``; ``**buffer_kwargs`` go to the buffer."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        generator: torch.Generator | None = None,
        buffer_dtype: torch.dtype = torch.float32,
        shared_params: Iterable[torch.nn.Parameter] | None = None,
        **buffer_kwargs: Any,
    ) -> None:
        super().__init__(optimizer, "pcgrad", generator, buffer_dtype, shared_params, buffer_kwargs)


class GEM(SurgeryOptimizer):
    """``SurgeryOptimizer(optimizer, method="gem", proposal=..., ...)``
    (:func:`~fastpals.surgery.gem_weights`); with :meth:`gem_backward`'s ``memory_losses`` (one per task,
    ``2 T`` buffer rows) the memory's gradients are the constraints."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        proposal: str | int = "sum",
        buffer_dtype: torch.dtype = torch.float32,
        shared_params: Iterable[torch.nn.Parameter] | None = None,
        max_iter: int | None = None,
        tol: float = 1e-12,
        ridge: float = 1e-12,
        **buffer_kwargs: Any,
    ) -> None:
        if not (
            proposal in ("sum", "mean") or (isinstance(proposal, int) and not isinstance(proposal, bool))
        ):
            raise ValueError(f"proposal must be 'sum', 'mean' or a task index, got {proposal!r}")
        self.proposal = proposal
        self.solver_options = {"max_iter": max_iter, "tol": tol, "ridge": ridge}
        super().__init__(
            optimizer, "gem", None, buffer_dtype, shared_params, buffer_kwargs, proposal=proposal,
            **self.solver_options,
        )  # fmt: skip

    def gem_backward(
        self, losses: Sequence[torch.Tensor], memory_losses: Sequence[torch.Tensor] | None = None
    ) -> SurgeryResult:
        """Zero the gradients, back-propagate the (memory and) task losses, write the GEM update into ``.grad``."""
        losses = self._check_losses(losses, "losses")
        t = len(losses)
        if isinstance(self.proposal, int) and not 0 <= self.proposal < t:
            raise ValueError(f"proposal task {self.proposal} is out of range for {t} losses")
        if memory_losses is None:
            return SurgeryOptimizer.backward(self, losses)
        shared, specific = self._split(losses)
        self.optimizer.zero_grad(set_to_none=True)
        memory_losses = self._check_losses(memory_losses, "memory_losses")
        if len(memory_losses) != t:
            raise ValueError(
                f"memory_losses has {len(memory_losses)} losses but losses has {t}: one per task"
            )
        buf = self._buffer_for(shared, specific, 2 * t)
        self._backward_into(buf, memory_losses, t)
        # Memory gradients only constrain the update: drop what they left in the task-specific parameters.
        buf.drop_task_grads()
        self._backward_into(buf, losses, 0)
        a = torch.cat(
            [proposal_vector(self.proposal, t, torch.device("cpu")), torch.zeros(t, dtype=torch.float64)]
        )
        result = buf.apply(gem_weights, proposal=a, constraints=list(range(t, 2 * t)), **self.solver_options)
        return self._finish(result)

    backward = gem_backward
    pc_backward = gem_backward
