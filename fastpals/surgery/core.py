"""The surgery core shared by the buffer and the stream: Gram -> aggregator weights -> combined update; a
memory mode supplies ``_finish_gram`` and ``_write_update``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from fastpals.functional import MAX_TASKS

GradGetter = Callable[[torch.nn.Parameter], "torch.Tensor | None"]
GradSetter = Callable[[torch.nn.Parameter, "torch.Tensor | None"], None]
Aggregator = Callable[..., torch.Tensor]


def default_grad_getter(p: torch.nn.Parameter) -> torch.Tensor | None:
    """``p.grad``."""
    return p.grad


def default_grad_setter(p: torch.nn.Parameter, value: torch.Tensor | None) -> None:
    """``p.grad = value`` (``None`` clears it)."""
    p.grad = value


class SurgeryResult:
    """What :meth:`TaskGradients.apply` did: ``skipped`` (a gradient was non-finite: do not step),
    ``weights [T]`` (None when skipped), ``gram [T, T]`` float32, ``nonfinite_tasks`` (rows with inf/nan),
    ``nonfinite_task_params``.

    A result of ``apply(..., sync=False)`` holds ``flags [T + 1]`` (each row's finite flag, then the
    task-specific gradients') and ``ok`` (all of them) on the device: the host fields read them on first
    access, or the caller passes its own read of ``flags`` to :meth:`resolve`.
    """

    def __init__(
        self,
        skipped: bool | None,
        weights: torch.Tensor | None,
        gram: torch.Tensor,
        nonfinite_tasks: Sequence[int] = (),
        nonfinite_task_params: bool = False,
        *,
        flags: torch.Tensor | None = None,
        on_skip: Callable[[], None] | None = None,
    ) -> None:
        self._skipped = skipped
        self.weights = weights  # a pending result's device weights, None once resolved as skipped
        self.gram = gram
        self._nonfinite_tasks = list(nonfinite_tasks)
        self._nonfinite_task_params = nonfinite_task_params
        self.flags = flags
        self._on_skip = on_skip
        self.ok = None if flags is None else flags.all()

    def resolve(self, host: Sequence[float | bool]) -> None:
        """Settle a deferred result with its ``flags`` read on the host by the caller (no read here)."""
        if self._skipped is None:
            host = [bool(f) for f in host]
            if len(host) != self.flags.shape[0]:
                raise ValueError(f"resolve needs the {self.flags.shape[0]} flags, got {len(host)}")
            self._skipped = not all(host)
            self._nonfinite_tasks = [t for t, f in enumerate(host[:-1]) if not f]
            self._nonfinite_task_params = not host[-1]
            if self._skipped:
                self.weights = None
                if self._on_skip is not None:
                    self._on_skip()

    def _resolve(self) -> None:
        if self._skipped is None:
            self.resolve(self.flags.tolist())  # the one host read of a deferred result

    @property
    def skipped(self) -> bool:
        self._resolve()
        return bool(self._skipped)

    @property
    def nonfinite_tasks(self) -> list[int]:
        self._resolve()
        return self._nonfinite_tasks

    @property
    def nonfinite_task_params(self) -> bool:
        self._resolve()
        return self._nonfinite_task_params

    def __repr__(self) -> str:
        state = "pending" if self._skipped is None else f"skipped={self._skipped}"
        return f"SurgeryResult({state}, nonfinite_tasks={self._nonfinite_tasks})"


def unique_params(params: Iterable[torch.nn.Parameter], name: str) -> list[torch.nn.Parameter]:
    """``params`` without repeats, in order; a ``TypeError`` naming ``name`` for anything but tensors."""
    out: dict[int, torch.nn.Parameter] = {}
    for p in params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name} must hold tensors (parameters), got {type(p).__name__}")
        out.setdefault(id(p), p)
    return list(out.values())


class TaskGradients:
    """Per-task gradients of the shared parameters, reduced to one update by :meth:`apply`.

    Args:
        params: the parameters shared by the tasks (the Gram is over them), on one device.
        task_params: task-specific parameters: not in the Gram, but in the finite check and the data-parallel
            average; :attr:`task_param_tasks` records which tasks touched each.
        grad_getter / grad_setter: how gradients are read and written (default ``p.grad``; ``None`` clears).
        process_group / all_reduce: data parallel: average the task gradients over the group before the Gram.
        capture_task_params: take the task-specific gradients out at each capture and write them back in
            :meth:`apply` (where backwards replace gradients instead of adding, as DeepSpeed ZeRO-1/2).
    """

    _repr_fields: tuple[str, ...] = ()  # a mode's settings shown by repr

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        num_tasks: int,
        *,
        task_params: Iterable[torch.nn.Parameter] | None = None,
        grad_getter: GradGetter | None = None,
        grad_setter: GradSetter | None = None,
        grad_dtype: torch.dtype | None = None,
        process_group: Any = None,
        all_reduce: bool = False,
        capture_task_params: bool = False,
    ) -> None:
        self.params = unique_params(params, "params")
        if not self.params:
            raise ValueError(f"params is empty: {type(self).__name__} needs at least one shared parameter")
        if not isinstance(num_tasks, int) or not 1 <= num_tasks <= MAX_TASKS:
            raise ValueError(f"num_tasks must be an int in [1, {MAX_TASKS}], got {num_tasks!r}")
        devices = {p.device for p in self.params}
        dtypes = {p.dtype for p in self.params}
        if len(devices) != 1:
            raise ValueError(f"params must all be on one device, got {sorted(map(str, devices))}")
        if len(dtypes) != 1 and grad_dtype is None:
            raise ValueError(f"params have several dtypes {sorted(map(str, dtypes))}: pass grad_dtype")
        shared_ids = {id(p) for p in self.params}
        given = unique_params(task_params or [], "task_params")
        self.task_params = [p for p in given if id(p) not in shared_ids]
        if len(self.task_params) != len(given):
            raise ValueError("a parameter cannot be both shared (params) and task-specific (task_params)")
        self.device = devices.pop()
        self.num_tasks = num_tasks
        self.grad_dtype = grad_dtype or next(iter(dtypes))
        self.grad_getter = grad_getter or default_grad_getter
        self.grad_setter = grad_setter or default_grad_setter
        self.process_group = process_group
        self.all_reduce = all_reduce or process_group is not None
        self.capture_task_params = capture_task_params
        self.numels = [p.numel() for p in self.params]
        self.num_elements = sum(self.numels)
        self.task_param_tasks: list[set[int]] = [set() for _ in self.task_params]
        self._task_acc: list[torch.Tensor | None] = [None] * len(self.task_params)
        self._task_seen = [False] * len(self.task_params)
        self._touched = [[False] * len(self.params) for _ in range(num_tasks)]
        self.skipped_steps = 0
        self.steps = 0

    def _finish_gram(self) -> torch.Tensor:
        """``[T, T]`` float32 Gram of this step's task gradients (globally averaged when data parallel)."""
        raise NotImplementedError

    def _write_update(self, weights: torch.Tensor, touched: Sequence[Sequence[Any]]) -> None:
        """``sum_t weights[t] g_t`` into the shared gradients (None where no task ``touched[t][k]`` one)."""
        raise NotImplementedError

    def _end_step(self) -> None:
        self.steps += 1

    def _take_task_grad(self, k: int, g: torch.Tensor) -> None:
        """Move task parameter ``k``'s gradient into its float32 copy (zeroed at the first capture)."""
        p = self.task_params[k]
        if self._task_acc[k] is None:
            self._task_acc[k] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if not self._task_seen[k]:
            self._task_acc[k].zero_()
        self._task_acc[k].add_(g.detach())
        self._task_seen[k] = True
        self.grad_setter(p, None)

    def _count_skip(self) -> None:
        self.skipped_steps += 1

    def apply(
        self,
        aggregator: Aggregator,
        generator: torch.Generator | None = None,
        *,
        sync: bool = True,
        **aggregator_kwargs: Any,
    ) -> SurgeryResult:
        """Gram -> ``aggregator(gram, generator=generator, **aggregator_kwargs)`` -> ``sum_t w_t g_t`` into .grad.

        One host read, the finite checks; when one fails the step is skipped (shared gradients ``None``, the
        aggregator not called). ``sync=False`` (one rank): no host read; the aggregator runs on the identity
        where the device flags (``result.ok``) fail, and the caller must not step then.
        """
        if self.all_reduce and (not dist.is_available() or not dist.is_initialized()):
            raise RuntimeError("all_reduce/process_group given but torch.distributed is not initialised")
        if self.all_reduce and not sync:
            raise ValueError("apply(sync=False) is for one rank (the all-reduced flags are read on the host)")
        t = self.num_tasks
        g_mat = self._finish_gram()

        def settle(host: Sequence[Any], touched: Sequence[Sequence[Any]]) -> SurgeryResult:
            """The host-checked end: ``host`` holds the ``T`` row flags, then the task-specific one."""
            if not all(host):
                self._count_skip()
                self._end_step()
                return SurgeryResult(
                    True, None, g_mat, [i for i in range(t) if not host[i]], not all(host[t:])
                )
            weights = aggregator(
                self._aggregator_input(aggregator, g_mat), generator=generator, **aggregator_kwargs
            )
            self._write_update(weights, touched)
            self._end_step()
            return SurgeryResult(False, weights, g_mat)

        finite = torch.isfinite(torch.diagonal(g_mat))
        if self.capture_task_params:
            task_grads = [acc if seen else None for acc, seen in zip(self._task_acc, self._task_seen)]
        else:
            task_grads = [self.grad_getter(p) for p in self.task_params]
        if self.all_reduce:
            flags = torch.tensor(
                [x for row in self._touched for x in row] + [g is not None for g in task_grads],
                dtype=torch.float32, device=self.device,
            )  # fmt: skip
            dist.all_reduce(flags, group=self.process_group)
            checks, task_flat = [], None
            if self.task_params:
                task_flat = torch.cat([
                    g.detach().reshape(-1).float() if g is not None else torch.zeros(p.numel(), device=self.device)
                    for p, g in zip(self.task_params, task_grads)
                ])  # fmt: skip
                task_flat.div_(dist.get_world_size(self.process_group))
                dist.all_reduce(task_flat, group=self.process_group)
                checks.append(torch.isfinite(task_flat.norm()).reshape(1))
            host = torch.cat([finite] + checks + [flags > 0]).tolist()  # the one host read
            n = len(self.params)
            used = host[t + len(checks) :]
            touched = [used[i * n : (i + 1) * n] for i in range(t)]
            if task_flat is not None:
                parts = torch.split(task_flat, [p.numel() for p in self.task_params])
                for p, part, u in zip(self.task_params, parts, used[t * n :]):
                    self.grad_setter(p, part.view_as(p).to(p.dtype) if u else None)
            return settle(host[: t + len(checks)], touched)
        touched = self._touched
        present = [g.detach() for g in task_grads if g is not None]  # one fused norm: are they finite?
        task_ok = (
            torch.isfinite(torch.stack(torch._foreach_norm(present))).all().reshape(1) if present else None
        )
        if self.capture_task_params:  # the captured copies back (reused accumulators: hand over copies)
            for p, g in zip(self.task_params, task_grads):
                if g is not None:
                    self.grad_setter(p, g.to(p.dtype) if g.dtype != p.dtype else g.clone())
        if sync:  # the one host read
            return settle(torch.cat([finite] + ([task_ok] if task_ok is not None else [])).tolist(), touched)
        if task_ok is None:
            task_ok = torch.ones(1, dtype=torch.bool, device=self.device)
        flags_dev = torch.cat([finite, task_ok])
        # finite weights without a host read: the aggregator on the identity (zero rows) where a flag fails
        x = self._aggregator_input(aggregator, g_mat)
        square = x.shape[0] == x.shape[1]
        fallback = torch.eye(x.shape[0], dtype=x.dtype, device=x.device) if square else torch.zeros_like(x)
        safe = torch.where(flags_dev.all(), torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), fallback)
        weights = aggregator(safe, generator=generator, **aggregator_kwargs)
        self._write_update(weights, touched)
        self._end_step()
        return SurgeryResult(None, weights, g_mat, flags=flags_dev, on_skip=self._count_skip)

    def __repr__(self) -> str:
        mode = "".join(f"{k}={getattr(self, k)!r}, " for k in self._repr_fields)
        return (
            f"{type(self).__name__}(num_tasks={self.num_tasks}, shared_elements={self.num_elements}, {mode}"
            f"task_params={len(self.task_params)}, all_reduce={self.all_reduce})"
        )

    def _aggregator_input(self, aggregator: Aggregator, g_mat: torch.Tensor) -> torch.Tensor:
        """The Gram, or the ``[T, P]`` rows for an aggregator marked ``reads_rows`` (ExcessMTL)."""
        return self._task_rows() if getattr(aggregator, "reads_rows", False) else g_mat

    def _task_rows(self) -> torch.Tensor:
        """``[T, P]`` task gradients after ``_finish_gram`` (a mode that keeps them)."""
        raise ValueError(
            f"{type(self).__name__} keeps no [T, P] task gradients, which this --surgery method reads: "
            "use --surgery-memory buffer (a TaskGradientBuffer)"
        )
