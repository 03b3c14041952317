"""A CUDA-faithful trace on a CPU-only machine: fake tensors on device ``cuda``, the op library's dispatch
resolving its CUDA backends for a pretended compute capability, and a count of the device kernels launched.

``with fake_cuda((9, 0)), LaunchCounter() as launches:`` runs a step on fake ``cuda`` tensors: no arithmetic is done, a CPU tensor meeting a ``cuda`` one raises ``FakeTensorDeviceMismatchError``
and any host read of a device value (``.item()``, ``.tolist()``, a data-dependent branch) raises as well.
``launches.total`` is then the number of kernels the step would launch: every aten op that writes memory
(views, metadata-only ops and uninitialised allocations launch nothing) and every custom op (one Triton
launch each); a ``torch._foreach_*`` op counts once (CUDA's multi-tensor apply launches one kernel per about
a hundred tensors or 20M elements).
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bench.fake_cuda import runtime_loaded
from fastpals import MultiTaskBert
from fastpals.data.mixed_batches import TaskRows, model_inputs, pack_task_rows
from fastpals.encoder.bert import BertConfig, PALConfig
from fastpals.model.multitask import MultiTaskConfig, TaskSpec
from fastpals.surgery import (
    AGGREGATORS,
    StreamingTaskGradients,
    TaskGradientBuffer,
    compiled,
    per_task_gradients,
    shared_parameters_by_name,
)
from fastpals.train.optimizer_setup import make_optimizer

__all__ = ["LaunchCounter", "check_guards", "fake_cuda", "launches_kernel", "main", "trace_updates"]

#: aten ops that allocate or only read/write tensor metadata: no kernel
_NO_KERNEL = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "resize_",
    "set_",
    "lift_fresh",
    "_local_scalar_dense",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
}


def _is_view(func: torch._ops.OpOverload) -> bool:
    """The op returns an alias of an input without writing it (``view``, ``t``, ``slice``, ``detach``...)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _on_device(tree: Any) -> bool:
    """Some tensor of ``tree`` is on the (fake) CUDA device: the op runs there, not on the host."""
    return any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in tree_leaves(tree))


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """Does ``func`` launch a device kernel? Custom ops (one Triton or library launch) and every aten op but
    views, allocations and metadata-only ops."""
    namespace = func.namespace
    if namespace in ("prim", "profiler"):  # prim.device, record_function: no kernel
        return False
    if namespace not in ("aten", "prims"):
        return True
    return func._opname not in _NO_KERNEL and not _is_view(func)


class LaunchCounter(TorchDispatchMode):
    """Counts, by op name, the kernels launched by the ops dispatched inside it (see the module docstring).

    Enter it inside ``FakeTensorMode`` so that it sees each op before the fake mode runs it. ``counts`` maps
    ``namespace.op`` to its launches; ``total`` sums them; ``pause()`` stops counting for a block.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._active = True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._active and launches_kernel(func) and _on_device((args, kwargs, out)):
            self.counts[f"{func.namespace}.{func._opname}"] += 1
        return out

    @property
    def total(self) -> int:
        """All launches counted."""
        return sum(self.counts.values())

    def matching(self, pattern: str) -> int:
        """Launches of the ops whose ``namespace.op`` name matches the regular expression ``pattern``."""
        return sum(n for name, n in self.counts.items() if re.search(pattern, name))

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Do not count the ops of this block."""
        before, self._active = self._active, False
        try:
            yield
        finally:
            self._active = before


@contextlib.contextmanager
def fake_cuda(capability: tuple[int, int], name: str = "pretended GPU") -> Iterator[FakeTensorMode]:
    """A ``FakeTensorMode`` in which tensors may live on ``cuda`` and ``torch.cuda`` reports one device of compute
    ``capability`` for the dispatch decisions (``is_available``, ``get_device_capability``, ``get_device_name``,
    ``device_count``). Nothing runs on that device: every tensor made inside is fake."""
    if not torch.cuda._is_compiled() and not runtime_loaded():
        raise RuntimeError(
            "fake_cuda on a CPU-only torch needs bench.fake_cuda.load_runtime() before torch is imported"
        )
    with contextlib.ExitStack() as stack:
        mode = stack.enter_context(FakeTensorMode())  # entered while CUDA is absent: it avoids device init
        for attr, value in (
            ("is_available", lambda: True),
            ("get_device_capability", lambda device=None: capability),
            ("get_device_name", lambda device=None: f"{name} sm_{capability[0]}{capability[1]}"),
            ("device_count", lambda: 1),
        ):
            stack.enter_context(mock.patch.object(torch.cuda, attr, value))
        # the weight solve's op has its CUDA kernel wherever the extension was built with nvcc (the GPU machine)
        stack.enter_context(mock.patch.object(compiled, "enabled", lambda gram: compiled.load()))
        yield mode


# --------------------------------------------------------------------------------------------------------------
# One training update at BERT-base shapes
# --------------------------------------------------------------------------------------------------------------
DEVICE = "cuda"
SM90, SM75 = (9, 0), (7, 5)
AGGREGATOR_NAMES = ("pcgrad", "upgrad", "mgda", "imtlg")
ROWS_PER_TASK = 2
LENGTH = 32


def _model(num_tasks: int, layers: int = 12) -> MultiTaskBert:
    """BERT-base (768 hidden, 12 heads, 3072 FFN) with ``layers`` layers, default PALs, ``num_tasks`` binary tasks:
    built on ``meta`` (no random draw), then given uninitialised (fake) storage on ``cuda``."""
    tasks = [TaskSpec(f"task{t}", "binary") for t in range(num_tasks)]
    cfg = MultiTaskConfig(BertConfig(num_hidden_layers=layers), tasks, PALConfig(num_tasks=num_tasks))
    with torch.device("meta"):
        model = MultiTaskBert(cfg)
    moved: dict[int, torch.Tensor] = {}  # a fake cuda tensor in place of each meta one (tied ones stay tied)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in moved:
                    data = torch.empty_like(t, device=DEVICE)
                    is_param = isinstance(t, torch.nn.Parameter)
                    moved[id(t)] = torch.nn.Parameter(data, t.requires_grad) if is_param else data
                table[name] = moved[id(t)]
    return model.train()


def _batch(num_tasks: int) -> dict:
    """``ROWS_PER_TASK`` examples per task, collated on the host as the trainer does (lengths up to ``LENGTH``)."""
    rng = np.random.default_rng(0)
    parts = []
    for t in range(num_tasks):
        ids = [
            list(rng.integers(1000, 30000, size=k))
            for k in rng.integers(LENGTH // 2, LENGTH + 1, ROWS_PER_TASK)
        ]
        labels = torch.as_tensor(rng.integers(0, 2, ROWS_PER_TASK), dtype=torch.float32)
        parts.append(TaskRows(t, ids, [[0] * len(x) for x in ids], labels=labels))
    return pack_task_rows(parts, num_tasks)


def trace_updates(
    num_tasks: int,
    variants: Sequence[tuple[str | None, str]],
    capability: tuple[int, int] = SM90,
    layers: int = 12,
) -> list[dict[str, Any]]:
    """One update per ``(surgery, memory)`` variant (surgery None: plain training; memory ``buffer`` or
    ``stream``) on one fake ``cuda`` model: forward, losses, backward with the one-backward capture, Gram,
    weights, combine, AdamW step (its state made beforehand, as from the second update on). Returns per variant
    its launches: ``total``, ``solve`` (the aggregator's), ``gram`` and ``combine`` (the op library's ops),
    and ``counts`` per op."""
    out = []
    with fake_cuda(capability):
        model = _model(num_tasks, layers)
        opt = make_optimizer([{"params": [p for p in model.parameters() if p.requires_grad]}], "adamw")
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        opt.step()
        shared, specific = shared_parameters_by_name(model)
        batch = _batch(num_tasks)
        for surgery, memory in variants:
            solve = {"launches": 0}
            with LaunchCounter() as launches:
                inputs = model_inputs(batch, DEVICE)
                labels = batch["labels"].to(DEVICE, non_blocking=True)
                opt.zero_grad(set_to_none=True)
                if surgery is None:
                    model.task_losses(model(**inputs), labels, weighting="equal").total.backward()
                else:
                    make = TaskGradientBuffer if memory == "buffer" else StreamingTaskGradients
                    buf = make(shared, num_tasks, task_params=specific)
                    with per_task_gradients(model, buf, inputs["layout"]):
                        res = model.task_losses(model(**inputs), labels, weighting="equal")
                        sum(res.per_task.values()).backward()

                    def counted(
                        gram: torch.Tensor, _name: str = surgery, _solve: dict = solve, **kwargs: Any
                    ) -> torch.Tensor:
                        before = launches.total
                        weights = AGGREGATORS[_name](gram, **kwargs)
                        _solve["launches"] = launches.total - before
                        return weights

                    result = buf.apply(counted, sync=False)
                    assert result.ok is not None and result.ok.device.type == "cuda"
                opt.step()
            out.append({
                "surgery": surgery, "memory": memory if surgery else None, "tasks": num_tasks,
                "capability": list(capability), "layers": layers, "total": launches.total,
                "solve": solve["launches"], "gram": launches.matching(r"fastpals\.gram"),
                "combine": launches.matching(r"fastpals\.combine"), "counts": dict(launches.counts),
            })  # fmt: skip
    return out


def check_guards() -> None:
    """The trace's guards themselves: in :func:`fake_cuda`, a CPU tensor meeting a ``cuda`` one raises, and so
    does a host read of a ``cuda`` value."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorDeviceMismatchError

    with fake_cuda(SM90):
        x = torch.ones(4, device=DEVICE)
        for bad, error in (
            (lambda: x + torch.ones(4), FakeTensorDeviceMismatchError),
            (lambda: x.sum().item(), DataDependentOutputException),
            (lambda: x.tolist(), DataDependentOutputException),
            (lambda: bool((x > 0).all()), DataDependentOutputException),
        ):
            try:
                bad()
            except error:
                continue
            raise AssertionError(f"fake_cuda let {bad} pass")


def main(argv: list[str] | None = None) -> None:
    """``python -c "from bench.fake_cuda import load_runtime; load_runtime(); from bench.cuda_trace import main;
    main()" CASES_JSON``: for each case ``{"tasks", "variants": [[surgery, memory], ...], "capability",
    "layers"}`` prints one JSON line per variant (:func:`trace_updates`); the case ``{"check": "guards"}`` runs
    :func:`check_guards` and prints ``{"guards": "ok"}``."""
    import json
    import sys

    for case in json.loads((argv or sys.argv[1:])[0]):
        if case.get("check") == "guards":
            check_guards()
            print(json.dumps({"guards": "ok"}), flush=True)
            continue
        variants = [tuple(v) for v in case["variants"]]
        capability = tuple(case.get("capability", SM90))
        for row in trace_updates(case["tasks"], variants, capability, case.get("layers", 12)):
            print(json.dumps(row), flush=True)
