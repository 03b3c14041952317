"""Activation checkpointing (``--activation-checkpointing``): the same gradients, less memory.

- fastpals' minBERT with PALs, in training mode (dropout on: the recomputed forward must replay the same masks):
  the ordinary gradients, and the per-task gradients of one-backward surgery (every task's row, one encoder pass
  and siamese pairs with two), equal those without checkpointing within 1e-6 (each layer counted once, though
  its forward runs twice);
- the measured CPU peak of live tensor storage of the MiniLM step (:func:`fastpals.commands.memory.measure_step`, real
  tensors) falls, and so does the planner's prediction;
- :func:`fastpals.inject_pals` on an HF ``BertModel`` after ``gradient_checkpointing_enable()``: outputs and
  gradients equal those of the same model without checkpointing (HF's own BERT is the reference).
"""

from __future__ import annotations

import copy

import pytest
import torch

from fastpals import MultiTaskBert, PALConfig
from fastpals.encoder.bert import BertConfig
from fastpals.model.multitask import MultiTaskConfig, TaskSpec
from fastpals.surgery import TaskGradientBuffer, per_task_gradients, shared_parameters_by_name

T = 3


def _tiny(pair_mode: str) -> MultiTaskBert:
    cfg = BertConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40,
    )  # fmt: skip
    other = "sbert_concat" if pair_mode == "sbert_cosine" else pair_mode
    tasks = [
        TaskSpec("sst", "classification", num_labels=5),
        TaskSpec("para", "binary", pair=True, pair_mode=other),
        TaskSpec("sts", "regression", pair=True, label_scale=5.0, pair_mode=pair_mode),
    ]
    torch.manual_seed(0)
    model = MultiTaskBert(MultiTaskConfig(cfg, tasks, PALConfig(num_tasks=T, hidden=12, num_heads=2)))
    gen = torch.Generator().manual_seed(3)
    for name, p in model.named_parameters():  # non-zero PAL decoders: the PALs change the encoder's gradients
        if "dec_weight" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.05
    return model.train()  # dropout on


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    b, n = 6, 10
    mask = (torch.arange(n)[None] < torch.randint(3, n + 1, (b,), generator=gen)[:, None]).long()
    mask_b = (torch.arange(n - 2)[None] < torch.randint(3, n - 1, (b,), generator=gen)[:, None]).long()
    return {
        "input_ids": torch.randint(5, 120, (b, n), generator=gen) * mask,
        "attention_mask": mask,
        "input_ids_b": torch.randint(5, 120, (b, n - 2), generator=gen) * mask_b,
        "attention_mask_b": mask_b,
        "task_ids": torch.tensor([0, 0, 1, 1, 2, 2]),
        "labels": torch.tensor([1.0, 4.0, 0.0, 1.0, 2.5, 4.0]),
    }


def _loss(model: MultiTaskBert, d: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(
        d["input_ids"], d["attention_mask"], None, d["task_ids"],
        input_ids_b=d["input_ids_b"], attention_mask_b=d["attention_mask_b"],
    )  # fmt: skip
    return model.loss(out, d["labels"])[0]


def _run(model: MultiTaskBert, checkpointed: bool, one_backward: bool) -> tuple[torch.Tensor, list, int]:
    """Rows ``[T, P]`` of the buffer (one backward) or the shared gradients (plain), the other gradients, and
    the shared-module forwards the per-task capture counted."""
    model.bert.set_activation_checkpointing(checkpointed)
    model.zero_grad(set_to_none=True)
    shared, specific = shared_parameters_by_name(model)
    torch.manual_seed(7)  # the dropout masks
    if one_backward:
        buf = TaskGradientBuffer(shared, T, torch.float32, task_params=specific)
        with per_task_gradients(model, buf, _batch()["task_ids"]) as state:
            _loss(model, _batch()).backward()
        rows, calls = buf.data, state.forward_calls
    else:
        _loss(model, _batch()).backward()
        rows, calls = torch.cat([p.grad.reshape(-1) for p in shared])[None], 0
    return rows, [None if p.grad is None else p.grad.clone() for p in specific], calls


@pytest.mark.parametrize("one_backward", [False, True], ids=["plain", "one_backward"])
@pytest.mark.parametrize("pair_mode", ["joint", "sbert_cosine"])
def test_gradients_unchanged(pair_mode: str, one_backward: bool) -> None:
    model = _tiny(pair_mode)
    want, want_specific, want_calls = _run(model, False, one_backward)
    got, got_specific, got_calls = _run(model, True, one_backward)
    assert got_calls == want_calls  # each shared layer counted once, though checkpointing runs it twice
    assert want.abs().sum() > 0 and all(want[t].abs().sum() > 0 for t in range(want.shape[0]))
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())
    for g, w in zip(got_specific, want_specific):
        assert (g is None) == (w is None)
        if w is not None:
            assert float((g - w).abs().max()) <= 1e-6 * max(float(w.abs().max()), 1e-12)


def test_eval_and_no_grad_run_without_checkpoints() -> None:
    model = _tiny("joint")
    model.bert.set_activation_checkpointing(True)
    model.eval()
    with torch.no_grad():
        a = _loss(model, _batch())
    model.bert.set_activation_checkpointing(False)
    with torch.no_grad():
        b = _loss(model, _batch())
    assert torch.equal(a, b)


def test_measured_cpu_peak_falls() -> None:
    """MiniLM (random weights from its config) with PALs, fp32, the plain mixed step of 8 examples of 64 tokens
    (the peak is the end of the forward): the measured peak of live tensor storage with checkpointing is lower,
    and the planner predicts both within 10%. (With one-backward surgery and fp32 rows the end of the backward,
    rows and all, is the peak at this size: checkpointing lowers it from batches of about 48 x 32 tokens on;
    ``docs/memory.md``.)"""
    from fastpals.commands.memory import StepSpec, measure_step, trace_step

    peaks = {}
    for ckpt in (False, True):
        spec = StepSpec(model="minilm-l6", max_length=64, precision="fp32", activation_checkpointing=ckpt)
        peaks[ckpt] = (measure_step(spec, 8).peak_bytes, trace_step(spec, 8).peak_bytes)
    print(f"MiniLM plain step, 8 x 64 tokens: peak (measured, predicted) {peaks}")
    assert peaks[True][0] < 0.95 * peaks[False][0]
    assert peaks[True][1] < 0.95 * peaks[False][1]
    for measured, predicted in peaks.values():
        assert 0.9 <= predicted / measured <= 1.1


@pytest.mark.parametrize("enable", ["before", "after"])
def test_inject_pals_with_hf_gradient_checkpointing(enable: str) -> None:
    """``gradient_checkpointing_enable()`` before or after ``inject_pals``."""
    transformers = pytest.importorskip("transformers")
    from fastpals import inject_pals, remove_pals

    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.BertModel(cfg)
    ref = copy.deepcopy(base)
    if enable == "before":
        base.gradient_checkpointing_enable()
    models = {}
    for name, m in (("checkpointed", base), ("reference", ref)):
        inject_pals(m, PALConfig(num_tasks=2, hidden=8, num_heads=2))
        models[name] = m
    if enable == "after":
        base.gradient_checkpointing_enable()
    models["reference"].load_state_dict(models["checkpointed"].state_dict())
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 100, (4, 12), generator=gen)
    mask = (torch.arange(12)[None] < torch.tensor([12, 9, 5, 7])[:, None]).long()
    task_ids = torch.tensor([0, 1, 1, 0])
    out, grads = {}, {}
    for name, m in models.items():
        m.train()
        torch.manual_seed(5)  # the dropout masks
        y = m(input_ids=ids, attention_mask=mask, task_ids=task_ids).last_hidden_state
        (y.square() * mask[..., None]).sum().backward()
        out[name] = y.detach()
        grads[name] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    assert models["checkpointed"].encoder.layer[0].gradient_checkpointing
    assert torch.allclose(out["checkpointed"], out["reference"], rtol=0, atol=1e-6)
    assert grads["checkpointed"].keys() == grads["reference"].keys()
    assert any(".pal." in n for n in grads["reference"])
    for n, w in grads["reference"].items():
        assert float((grads["checkpointed"][n] - w).abs().max()) <= 1e-6 * max(float(w.abs().max()), 1e-12), n
    layer = models["checkpointed"].encoder.layer[0]
    assert hasattr(layer._gradient_checkpointing_func, "_fastpals_state")
    remove_pals(models["checkpointed"])  # gives HF its own checkpointing function back
    assert not hasattr(layer._gradient_checkpointing_func, "_fastpals_state")
