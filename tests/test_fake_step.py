"""A whole packed mixed-task training step under ``FakeTensorMode``: any read of a device value on the host
(``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``, ``nonzero``, ``unique``, a data-dependent branch) raises
inside fake mode, so these tests fail on any new synchronisation in the step: the forward, the losses, the
backward, the per-task gradient capture, the aggregator's apply and the optimizer step.

The batch is collated on the host as the trainer does (:func:`fastpals.data.mixed_batches.pack_task_rows`): its layout's
host values are real Python/NumPy values; every tensor, the model's parameters included, is fake.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fastpals import MultiTaskBert
from fastpals.data.mixed_batches import TaskRows, model_inputs, pack_task_rows
from fastpals.data.tasks import get_task
from fastpals.encoder.bert import BertConfig, PALConfig
from fastpals.model.multitask import MultiTaskConfig
from fastpals.surgery import (
    AGGREGATORS,
    TaskGradientBuffer,
    per_task_gradients,
    shared_parameters_by_name,
)

TASKS = ("sst", "para", "sts")


def _tiny_model() -> MultiTaskBert:
    bert = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    pal = PALConfig(hidden=12, num_heads=2)
    return MultiTaskBert(MultiTaskConfig(bert, [get_task(t) for t in TASKS], pal)).train()


def _batch(seed: int = 0) -> dict:
    """One mixed micro-batch of the three tasks, collated on the host from token lists (no padding)."""
    rng = np.random.default_rng(seed)
    parts = []
    for t, n in enumerate((3, 4, 2)):
        lengths = rng.integers(3, 12, size=n)
        ids = [list(rng.integers(5, 64, size=k)) for k in lengths]
        labels = [rng.integers(0, 5, n), rng.integers(0, 2, n), rng.random(n) * 5][t]
        parts.append(
            TaskRows(t, ids, [[0] * len(x) for x in ids], labels=torch.as_tensor(labels, dtype=torch.float32))
        )
    return pack_task_rows(parts, len(TASKS))


def _fake_step(surgery: str | None) -> None:
    with FakeTensorMode():  # every tensor made inside is fake; a host read of one raises
        torch.manual_seed(0)
        model = _tiny_model()
        batch = _batch()
        inputs = model_inputs(batch, "cpu")
        labels = batch["labels"]
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        opt.zero_grad(set_to_none=True)
        if surgery is None:
            res = model.task_losses(model(**inputs), labels, weighting="equal")
            res.total.backward()
        else:
            shared, specific = shared_parameters_by_name(model)
            buf = TaskGradientBuffer(shared, len(TASKS), task_params=specific)
            with per_task_gradients(model, buf, inputs["layout"]):
                res = model.task_losses(model(**inputs), labels, weighting="equal")
                sum(res.per_task.values()).backward()
            result = buf.apply(AGGREGATORS[surgery], generator=torch.Generator().manual_seed(0), sync=False)
            assert result.ok is not None and result.ok.shape == ()
        opt.step()
        # host values of the step come from the layout, not from the device
        assert res.examples == {"sst": 3, "para": 4, "sts": 2}
        assert set(res.tokens) == set(TASKS)


def test_fake_plain_step_reads_nothing_on_the_host() -> None:
    _fake_step(None)


@pytest.mark.parametrize("name", ["pcgrad", "gem", "mgda", "upgrad"])
def test_fake_one_backward_surgery_step_reads_nothing_on_the_host(name: str) -> None:
    _fake_step(name)


def test_fake_mode_catches_a_host_read() -> None:
    """The guard itself: a host read of a fake tensor raises (so the tests above cannot pass vacuously)."""
    with FakeTensorMode():
        x = torch.ones(3)
        with pytest.raises(Exception):  # noqa: B017 - torch raises its DataDependentOutputException
            x.sum().item()


def test_deferred_apply_equals_host_checked_apply() -> None:
    """``apply(sync=False)`` writes the same update as the host-checked ``apply`` and resolves ``skipped``."""
    torch.manual_seed(0)
    grads = []
    for sync in (True, False):
        model = _tiny_model()
        model.load_state_dict(_tiny_model_state())
        batch = _batch(1)
        inputs = model_inputs(batch, "cpu")
        shared, specific = shared_parameters_by_name(model)
        buf = TaskGradientBuffer(shared, len(TASKS), task_params=specific)
        torch.manual_seed(1)
        with per_task_gradients(model, buf, inputs["layout"]):
            res = model.task_losses(model(**inputs), batch["labels"], weighting="equal")
            sum(res.per_task.values()).backward()
        result = buf.apply(AGGREGATORS["pcgrad"], generator=torch.Generator().manual_seed(0), sync=sync)
        assert not result.skipped and result.nonfinite_tasks == []
        grads.append([p.grad.clone() for p in shared])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_deferred_apply_reports_a_nonfinite_task() -> None:
    model = _tiny_model()
    batch = _batch(2)
    inputs = model_inputs(batch, "cpu")
    shared, specific = shared_parameters_by_name(model)
    buf = TaskGradientBuffer(shared, len(TASKS), task_params=specific)
    with per_task_gradients(model, buf, inputs["layout"]):
        res = model.task_losses(model(**inputs), batch["labels"], weighting="equal")
        (res.per_task["sst"] + res.per_task["para"] * float("inf") + res.per_task["sts"]).backward()
    result = buf.apply(AGGREGATORS["pcgrad"], sync=False)
    assert not bool(result.ok)
    assert result.skipped and result.nonfinite_tasks == [1] and result.weights is None
    assert buf.skipped_steps == 1


_STATE: dict = {}


def _tiny_model_state() -> dict:
    if not _STATE:
        torch.manual_seed(123)
        _STATE.update(_tiny_model().state_dict())
    return _STATE
