"""fp16 with gradient surgery, rehearsed on the CPU: one-backward surgery (buffer and stream memory modes,
PCGrad and UPGrad) under fp16 autocast and ``torch.amp.GradScaler`` through :func:`fastpals.train.step.run_update`.
An overflow in one task's rows skips the step (nothing applied, optimizer state kept), lowers the scale, leaves
no gradient and no task rows behind, and the next update equals the one a run without the overflow makes; the
update matches a float64 reference (PCGrad transcribed from Yu et al. 2020's Algorithm 1, UPGrad from TorchJD)
within the error of the plain fp16 gradient; the Gram is fp32; a non-finite Gram never reaches the solver;
clipping sees the unscaled update. The ``gpu`` test runs the overflow under DeepSpeed's fp16 config."""

from __future__ import annotations

import copy
import gc
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from device import requires_cuda

from fastpals.data.mixed_batches import model_inputs, pack_batches
from fastpals.encoder.bert import BertConfig, PALConfig
from fastpals.model.multitask import MultiTaskBert, MultiTaskConfig, get_task
from fastpals.surgery import (
    StreamingTaskGradients,
    TaskGradientBuffer,
    pcgrad_orders,
    pcgrad_weights,
    shared_parameters_by_name,
    upgrad_weights,
)
from fastpals.train.step import (
    MicroBatch,
    Surgery,
    TorchEngine,
    deepspeed_surgery_buffer,
    run_update,
    skips_overflow,
)

ROOT = Path(__file__).resolve().parent.parent
TASKS = ("sst", "para", "sts")
INIT_SCALE = 2.0**10
AGGREGATORS = {"pcgrad": pcgrad_weights, "upgrad": upgrad_weights}


def _model(seed: int = 0) -> MultiTaskBert:
    """A tiny PAL-BERT with three tasks and no dropout (so that a float64 copy computes the same function)."""
    torch.manual_seed(seed)
    bert = BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    pal = PALConfig(hidden=16, num_heads=2, dropout=0.0, zero_init_decoder=False)
    tasks = [get_task(t) for t in TASKS]
    return MultiTaskBert(MultiTaskConfig(bert, tasks, pal, head_dropout=0.0)).train()


def packed_micro_batch(
    num_tasks: int, per_task: int, length: int, generator: torch.Generator, device: str = "cpu"
) -> MicroBatch:
    """One packed micro-batch of ``per_task`` examples of each task (the tiny model's 3 task kinds in turn),
    ``length // 2`` to ``length`` tokens each."""
    batches = []
    for t in range(num_tasks):
        lengths = torch.randint(length // 2, length + 1, (per_task,), generator=generator)
        mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        ids = torch.randint(5, 50, (per_task, length), generator=generator) * mask
        labels = [
            torch.randint(0, 5, (per_task,), generator=generator).float(),
            torch.randint(0, 2, (per_task,), generator=generator).float(),
            torch.rand(per_task, generator=generator) * 5,
        ][t % 3]
        batches.append(
            {
                "input_ids": ids,
                "attention_mask": mask,
                "token_type_ids": torch.zeros_like(ids),
                "labels": labels,
            }
        )
    packed = pack_batches(batches, list(range(num_tasks)), num_tasks)
    tokens = tuple(int(b["attention_mask"].sum()) for b in batches)
    tasks = tuple(range(num_tasks))
    labels = packed["labels"].to(device)
    return MicroBatch(
        model_inputs(packed, device), labels, tasks, (per_task,) * num_tasks, tokens, "examples"
    )


def _micro_batch(seed: int, device: str = "cpu") -> MicroBatch:
    """One packed micro-batch of 3 examples of each task."""
    return packed_micro_batch(3, 3, 8, torch.Generator().manual_seed(seed), device)


def _surgery(model: MultiTaskBert, memory: str, aggregator: str, seed: int = 0) -> Surgery:
    shared, specific = shared_parameters_by_name(model)
    if memory == "buffer":
        buffer = TaskGradientBuffer(shared, 3, task_params=specific)
    else:
        buffer = StreamingTaskGradients(shared, 3, task_params=specific, policy="stream")
    return Surgery(buffer, AGGREGATORS[aggregator], torch.Generator().manual_seed(seed))


def _fp16_engine(model: MultiTaskBert, optimizer: torch.optim.Optimizer, **kwargs) -> TorchEngine:
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    return TorchEngine(model, optimizer, scaler=scaler, autocast=torch.float16, **kwargs)


def _scale_task_gradient(model: MultiTaskBert, task: str, factor: float):
    """Multiply the gradient flowing out of ``task``'s head by ``factor`` (that task's rows only); the handle."""

    def pre_hook(module, args):
        (x,) = args
        if x.requires_grad:
            x.register_hook(lambda g: g * factor)

    return model.heads[task].register_forward_pre_hook(pre_hook)


def _storages() -> dict[int, int]:
    """Address -> bytes of every tensor storage reachable from Python."""
    return {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in gc.get_objects()
        if issubclass(type(t), torch.Tensor)  # type(): no attribute read on other objects
    }


def _bytes_kept(fn):
    """``fn()`` and the bytes of the tensor storages it made that are still alive after it (rows, gradients)."""
    before = _storages()
    out = fn()
    gc.collect()
    return out, sum(n for address, n in _storages().items() if address not in before)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    return [
        (f"{k}/{name}", v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v))
        for k, state in optimizer.state_dict()["state"].items()
        for name, v in state.items()
    ]


CASES = [("buffer", "pcgrad"), ("stream", "upgrad")]


@pytest.mark.parametrize("memory, aggregator", CASES)
def test_an_overflow_in_one_task_skips_the_step_and_the_next_update_goes_on(memory, aggregator):
    model, twin = _model(), _model()
    engine = _fp16_engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    twin_engine = _fp16_engine(twin, torch.optim.AdamW(twin.parameters(), lr=1e-2))
    surgery, twin_surgery = _surgery(model, memory, aggregator), _surgery(twin, memory, aggregator)
    for e, s in ((engine, surgery), (twin_engine, twin_surgery)):
        assert run_update(e, [_micro_batch(1)], "one_backward", surgery=s).stepped

    before, state = _params(model), _optimizer_state(engine.optimizer)
    rows = 3 * surgery.buffer.num_elements * 4  # what the fp32 task rows take
    handle = _scale_task_gradient(model, "para", 1e30)  # finite loss, inf in para's fp16 backward
    try:
        update, kept = _bytes_kept(
            lambda: run_update(engine, [_micro_batch(2)], "one_backward", surgery=surgery)
        )
    finally:
        handle.remove()
    assert update.surgery.skipped and update.overflow and not update.stepped
    assert update.surgery.nonfinite_tasks == [1]
    assert engine.scaler.get_scale() == INIT_SCALE * engine.scaler.get_backoff_factor()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    after = _optimizer_state(engine.optimizer)
    assert [k for k, _ in after] == [k for k, _ in state]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(after, state))
    assert all(p.grad is None for p in model.parameters())
    assert kept < 0.01 * rows, (kept, rows)  # no task row, no gradient left

    # the reference: the same updates without the overflow, at the scale the overflow left
    twin_engine.scaler.update(engine.scaler.get_scale())
    surgery.generator.manual_seed(3), twin_surgery.generator.manual_seed(3)
    update = run_update(engine, [_micro_batch(3)], "one_backward", surgery=surgery)
    twin_update = run_update(twin_engine, [_micro_batch(3)], "one_backward", surgery=twin_surgery)
    assert update.stepped and not update.overflow and twin_update.stepped
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.isfinite(p).all(), n
        assert torch.equal(p, q), n
    assert sum(not torch.equal(p, before[n]) for n, p in model.named_parameters()) > 0.9 * len(before)


def _reference_update(model: MultiTaskBert, mb: MicroBatch, aggregator: str, seed: int) -> torch.Tensor:
    """The surgery update of ``mb`` in float64 (no autocast, no scaling), flat over the shared then the
    task-specific parameters: per-task gradients by one backward per task; PCGrad as Yu et al. 2020's
    Algorithm 1 in the orders :func:`pcgrad_orders` draws from ``seed``; UPGrad by TorchJD."""
    ref = copy.deepcopy(model).double()
    shared, specific = shared_parameters_by_name(ref)
    res = ref.task_losses(ref(**mb.inputs), mb.labels.double(), weighting="equal")
    rows = [None] * 3
    for name, loss in res.per_task.items():
        grads = torch.autograd.grad(loss, shared, retain_graph=True, allow_unused=True)
        rows[ref.task_index(name)] = torch.cat([
            (g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, shared)
        ])  # fmt: skip
    jac = torch.stack(rows)
    if aggregator == "pcgrad":
        orders = pcgrad_orders(3, torch.Generator().manual_seed(seed))
        update = torch.zeros_like(jac[0])
        for i in range(3):
            g = jac[i].clone()
            for j in orders[i].tolist():
                dot = g @ jac[j]
                if dot < 0:
                    g -= dot / (jac[j] @ jac[j]) * jac[j]
            update += g
    else:
        from torchjd.aggregation import UPGrad

        update = UPGrad()(jac)
    task = torch.autograd.grad(sum(res.per_task.values()), specific, allow_unused=True)
    task = [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(task, specific)]
    return torch.cat([update, *task])


def _flat_step(model: MultiTaskBert, before: dict[str, torch.Tensor]) -> torch.Tensor:
    """``before - after`` (SGD with lr 1: the applied gradient), flat in the reference's order."""
    shared, specific = shared_parameters_by_name(model)
    names = {id(p): n for n, p in model.named_parameters()}
    return torch.cat([(before[names[id(p)]] - p.detach()).double().reshape(-1) for p in [*shared, *specific]])


def _relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


@pytest.mark.parametrize("memory, aggregator", CASES)
def test_the_fp16_update_matches_a_float64_reference(memory, aggregator):
    """The fp16 surgery update's error against float64 is at most twice that of the plain fp16 gradient (the
    sum of the task losses' gradient under the same autocast and scaler) against its float64 counterpart."""
    model = _model()
    mb = _micro_batch(5)  # its task gradients conflict (cosines -0.18, -0.18, 0.26)
    ref = _reference_update(model, mb, aggregator, seed=5)
    before = _params(model)
    engine = _fp16_engine(model, torch.optim.SGD(model.parameters(), lr=1.0))
    update = run_update(engine, [mb], "one_backward", surgery=_surgery(model, memory, aggregator, seed=5))
    assert update.stepped and engine.scaler.get_scale() == INIT_SCALE  # no overflow: the step was applied
    err = _relative_error(_flat_step(model, before), ref)

    plain = _model()  # the plain fp16 gradient (the micro-batch's loss) against float64: the budget
    ref64 = copy.deepcopy(plain).double()
    ref64.task_losses(ref64(**mb.inputs), mb.labels.double(), weighting=mb.weighting).total.backward()
    shared64, specific64 = shared_parameters_by_name(ref64)
    plain64 = torch.cat([p.grad.reshape(-1) for p in [*shared64, *specific64]])
    before = _params(plain)
    engine = _fp16_engine(plain, torch.optim.SGD(plain.parameters(), lr=1.0))
    assert run_update(engine, [mb], "none").stepped and engine.scaler.get_scale() == INIT_SCALE
    budget = _relative_error(_flat_step(plain, before), plain64)
    print(f"{memory} {aggregator}: fp16 surgery error {err:.2e}, plain fp16 gradient error {budget:.2e}")
    assert 0 < err <= 2 * budget
    sum_of_tasks = 3 * plain64  # three tasks of three examples each: the loss is the mean of the task losses
    assert _relative_error(ref, sum_of_tasks) > 100 * err  # the surgery changed the update: the check sees it


def test_the_gram_of_fp16_rows_is_accumulated_in_fp32():
    """fp16 rows hold the scaled gradients; their Gram (``S^2 |g|^2``) is beyond fp16's range and stays finite
    in fp32, and the update equals the fp32 rows' up to fp16 rounding."""
    steps = []
    for rows in (torch.float16, torch.float32):
        model = _model()
        shared, specific = shared_parameters_by_name(model)
        buffer = TaskGradientBuffer(shared, 3, rows, task_params=specific)
        surgery = Surgery(buffer, pcgrad_weights, torch.Generator().manual_seed(0))
        before = _params(model)
        engine = _fp16_engine(model, torch.optim.SGD(model.parameters(), lr=1.0))
        update = run_update(engine, [_micro_batch(5)], "one_backward", surgery=surgery)
        gram = update.surgery.gram
        assert update.stepped and gram.dtype == torch.float32 and torch.isfinite(gram).all()
        assert torch.diagonal(gram).max() > torch.finfo(torch.float16).max  # would be inf in fp16
        steps.append(_flat_step(model, before))
    assert _relative_error(steps[0], steps[1]) < 1e-3


def _recording(aggregator, grams: list[torch.Tensor]):
    def record(gram, generator=None, **kwargs):
        grams.append(gram.detach().clone())
        return aggregator(gram, generator=generator, **kwargs)

    return record


@pytest.mark.parametrize("memory, aggregator", CASES)
def test_a_non_finite_gram_skips_the_step_before_the_solver(memory, aggregator):
    """fp32 compute (no autocast) with one task's gradient 1e25 times larger: its rows stay finite, their squared
    norm overflows fp32. The update is skipped as an overflow and the solver never sees a non-finite Gram."""
    model = _model()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), scaler=scaler)
    surgery = _surgery(model, memory, aggregator)
    grams: list[torch.Tensor] = []
    surgery.aggregator = _recording(surgery.aggregator, grams)
    before = _params(model)
    handle = _scale_task_gradient(model, "para", 1e25)
    try:
        update = run_update(engine, [_micro_batch(5)], "one_backward", surgery=surgery)
    finally:
        handle.remove()
    assert update.overflow and update.surgery.nonfinite_tasks == [1]
    assert not torch.isfinite(torch.diagonal(update.surgery.gram)[1])
    assert grams and all(torch.isfinite(g).all() for g in grams)
    assert scaler.get_scale() < INIT_SCALE
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_buffer_with_finite_rows_and_an_overflowing_gram_calls_no_solver():
    """The buffer on its own: finite fp32 rows whose Gram overflows; ``apply`` skips without calling the
    aggregator, ``apply(sync=False)`` gives it only a finite Gram; no row outlives the skipped update's
    gradients."""
    params = [torch.nn.Parameter(torch.zeros(64, 64)), torch.nn.Parameter(torch.zeros(64))]
    for sync in (True, False):
        buffer = TaskGradientBuffer(params, 2)
        grams: list[torch.Tensor] = []
        result, kept = _bytes_kept(lambda: _capture_and_apply(buffer, params, grams, sync))  # noqa: B023
        assert result.skipped and result.nonfinite_tasks == [1]
        assert all(torch.isfinite(g).all() for g in grams) and len(grams) == (0 if sync else 1)
        assert kept < 0.01 * 2 * buffer.num_elements * 4, kept  # the rows are gone


def _capture_and_apply(buffer: TaskGradientBuffer, params, grams: list[torch.Tensor], sync: bool):
    for k, p in enumerate(params):
        buffer.param_row(0, k).copy_(torch.full(p.shape, 0.5))
        buffer.param_row(1, k).copy_(torch.full(p.shape, 1e20))  # finite; its squared norm is not
    buffer.capture_written([0, 1], [[True, True], [True, True]])
    assert torch.isfinite(buffer.data).all()
    result = buffer.apply(_recording(pcgrad_weights, grams), sync=sync)
    if result.skipped:  # as run_update: the skipped update's gradients go
        for p in params:
            p.grad = None
    return result


def test_clipping_sees_the_unscaled_update_after_surgery():
    """``max_grad_norm`` clips the unscaled surgery update: the step is that update rescaled to norm ``c``
    (clipping the scaled gradients would give norm ``c / S`` after unscaling)."""
    steps = []
    for clip in (None, 0.5):  # then half the unclipped update's norm
        model = _model()
        before = _params(model)
        if clip is not None:
            clip = clip * float(steps[0].norm())
        engine = _fp16_engine(model, torch.optim.SGD(model.parameters(), lr=1.0), max_grad_norm=clip)
        run_update(engine, [_micro_batch(5)], "one_backward", surgery=_surgery(model, "buffer", "pcgrad"))
        steps.append(_flat_step(model, before))
    free, clipped = steps
    assert abs(float(clipped.norm()) / clip - 1) < 1e-5
    assert _relative_error(clipped, free * (clip / free.norm())) < 1e-5


def _deepspeed_fp16_overflow(stage: int, memory: str) -> str:
    """Under ``fastpals/configs/gpu_fp16_zero{stage}.json`` (hysteresis 1, so one overflow halves the scale; an
    initial scale of 2^10, so that only the injected overflow overflows), on ``cuda``: an update, an overflow in
    one task's rows, an update. Runs in the DeepSpeed process of :func:`test_deepspeed_fp16_overflow`."""
    import deepspeed

    config = json.loads((ROOT / f"fastpals/configs/gpu_fp16_zero{stage}.json").read_text())
    config["fp16"].update(initial_scale_power=10, hysteresis=1)
    config.update(
        train_micro_batch_size_per_gpu=9, gradient_accumulation_steps=1, zero_allow_untested_optimizer=True
    )
    model = _model()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=config
    )
    assert skips_overflow(engine)
    buffer = deepspeed_surgery_buffer(engine.module, 3, stage, memory=memory)
    surgery = Surgery(buffer, pcgrad_weights, torch.Generator().manual_seed(0))
    assert run_update(engine, [_micro_batch(1, "cuda")], "one_backward", surgery=surgery).stepped
    scale, before = engine.optimizer.loss_scale, _params(engine.module)
    handle = _scale_task_gradient(engine.module, "para", 1e30)
    rows = 3 * buffer.num_elements * 4
    try:
        update, kept = _bytes_kept(
            lambda: run_update(engine, [_micro_batch(2, "cuda")], "one_backward", surgery=surgery)
        )
    finally:
        handle.remove()
    assert update.overflow and update.surgery.nonfinite_tasks == [1], update
    assert engine.skipped_steps == 1 and engine.optimizer.loss_scale == scale / 2
    assert all(torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    assert kept < 0.01 * rows, (kept, rows)
    update = run_update(engine, [_micro_batch(3, "cuda")], "one_backward", surgery=surgery)
    assert update.stepped and not update.overflow and engine.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())
    changed = sum(not torch.equal(p, before[n]) for n, p in engine.module.named_parameters())
    assert changed > 0.9 * len(before), changed
    return f"ZeRO-{stage} {memory}: overflow skipped, scale {scale} -> {scale / 2}, next update applied"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (not installed)")
def test_deepspeed_fp16_overflow():
    """The overflow rehearsal under DeepSpeed's fp16 configs (ZeRO 0, 1, 2; buffer and stream), one rank, in a
    subprocess (its process group stays out of the test session)."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}  # fmt: skip
    run = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


if __name__ == "__main__":  # the DeepSpeed process of test_deepspeed_fp16_overflow
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl")
    failed = 0
    for stage in (0, 1, 2):
        for memory in (
            "buffer",
            "stream",
        ):  # every case runs and reports, so that one GPU call shows them all
            try:
                print(_deepspeed_fp16_overflow(stage, memory), flush=True)
            except Exception as err:  # noqa: BLE001
                failed += 1
                print(f"ZeRO-{stage} {memory}: FAILED {type(err).__name__}: {err}", flush=True)
    sys.exit(1 if failed else 0)
