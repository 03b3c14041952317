"""The op library: ``fastpals_kernels`` stands alone, every op is a ``torch.ops.fastpals`` custom op that
``torch.library.opcheck`` accepts (schema, fake tensor, autograd registration, AOT dispatch) and that matches its
reference, the registry takes new backends, and ``torch.compile(fullgraph=True)`` traces the packed multi-task
model and an HF encoder with injected PALs without a graph break, matching eager."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from device import DEVICE, requires_cuda
from torch.library import opcheck

import fastpals_kernels
from fastpals_kernels import backends, dispatch, library
from fastpals_kernels.gram import gram_reference

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [torch.float32, torch.bfloat16]
T, D, DS, HEADS = 3, 16, 12, 2


def _w(
    g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32, grad: bool = True
) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * 0.2).to(dtype).requires_grad_(grad)


def _pal_operands(dtype: torch.dtype, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    weights = [
        _w(g, *s, dtype=dtype)
        for s in ((T, DS, D), (T, DS), (T, 3 * DS, DS), (T, 3 * DS), (T, D, DS), (T, D))
    ]
    h = _w(g, 4, 7, D, dtype=dtype)
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    task_ids = torch.tensor([2, 0, 1, 2])
    return h, mask, task_ids, weights, g


def test_importing_the_kernels_imports_no_fastpals_module():
    code = "import sys, fastpals_kernels; print(sorted(m for m in sys.modules if m.startswith('fastpals')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    modules = eval(out.stdout)
    assert modules and all(m == "fastpals_kernels" or m.startswith("fastpals_kernels.") for m in modules), (
        modules
    )


def test_no_kernel_module_imports_fastpals():
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for line in path.read_text().splitlines():
            stripped = line.strip()
            assert not stripped.startswith(("from fastpals.", "from fastpals ", "import fastpals\n")), (
                path,
                line,
            )
            assert stripped != "import fastpals", (path, line)


def test_the_namespace_holds_every_op():
    names = {"pal", "pal_varlen", "pal_backward", "pal_varlen_backward", "attention_varlen",
             "attention_varlen_backward", "grouped_wgrad", "gram", "combine", "combine_out", "combine_row"}  # fmt: skip
    assert names <= set(library.OPS)
    for name in names:
        assert hasattr(torch.ops.fastpals, name), name


# ------------------------------------------------------------------------------------------------------------
# opcheck and the references, per op and dtype (the PAL ops: tests/kernels/test_pal_op.py)
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_wgrad_opcheck_and_reference(dtype, with_bias):
    from fastpals_kernels.common import build_task_row_plan

    g = torch.Generator().manual_seed(2)
    task_ids = torch.tensor([1, 0, 2, 1])
    cu = torch.tensor([0, 3, 8, 9, 13])
    dy, x = _w(g, 13, 6, dtype=dtype, grad=False), _w(g, 13, 5, dtype=dtype, grad=False)
    plan = build_task_row_plan(task_ids, T, 13, cu_seqlens=cu, block_rows=4)
    args = (dy, x, plan.row_index, plan.task_row_offsets, plan.tile_task, plan.tile_start, plan.tile_end, T, 4,
            with_bias, torch.float32)  # fmt: skip
    opcheck(torch.ops.fastpals.grouped_wgrad.default, args)
    dw, db = dispatch.grouped_wgrad(dy, x, plan, torch.float32, with_bias)
    row_task = torch.repeat_interleave(task_ids, cu[1:] - cu[:-1])
    for t in range(T):
        rows = row_task == t
        want = dy[rows].double().T @ x[rows].double()
        torch.testing.assert_close(dw[t].double(), want, rtol=0, atol=1e-5)
        if with_bias:
            torch.testing.assert_close(db[t].double(), dy[rows].double().sum(0), rtol=0, atol=1e-5)
    assert (db is None) == (not with_bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gram_and_combine_opcheck_and_reference(dtype):
    g = torch.Generator().manual_seed(3)
    buf = _w(g, 3, 257, dtype=dtype)
    weights = _w(g, 3)
    opcheck(torch.ops.fastpals.gram.default, (buf,))
    opcheck(torch.ops.fastpals.combine.default, (buf, weights))
    plain = buf.detach()
    opcheck(torch.ops.fastpals.combine_out.default, (plain, weights.detach(), torch.empty(257)))
    opcheck(torch.ops.fastpals.combine_row.default, (plain.clone(), weights.detach(), 1))
    gram, finite = fastpals_kernels.gram(plain)
    want, _ = gram_reference(plain)
    torch.testing.assert_close(gram, want, rtol=0, atol=1e-5)
    assert finite.all()
    out = fastpals_kernels.combine(plain, weights.detach())
    torch.testing.assert_close(out, weights.detach() @ plain.float(), rtol=1e-5, atol=1e-5)
    in_place = plain.clone()
    fastpals_kernels.combine(in_place, weights.detach(), out_row=2)
    torch.testing.assert_close(in_place[2].float(), out.to(dtype).float(), rtol=0, atol=0)
    # the differentiable forms: d(gram)/d(buf) and d(combine)/d(buf, weights) against autograd on the math
    if dtype == torch.float32:
        x = buf.detach().double().requires_grad_()
        gg = torch.randn(3, 3, generator=g, dtype=torch.float64)
        (want_grad,) = torch.autograd.grad(x @ x.T, x, gg)
        (got_grad,) = torch.autograd.grad(torch.ops.fastpals.gram(buf)[0], buf, gg.float())
        torch.testing.assert_close(got_grad.double(), want_grad, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# The registry
# ------------------------------------------------------------------------------------------------------------
def test_a_registered_backend_serves_its_op(monkeypatch):
    calls = []

    def my_gram(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(buf.shape)
        return gram_reference(buf)

    dispatch.register_backend(
        "gram", "mine", lambda cap, dtype: "CPU test backend" if cap is None else None, my_gram
    )
    try:
        assert dispatch.decide("gram", None, torch.float32) == dispatch.Decision("mine", "CPU test backend")
        assert dispatch.decide("gram", (8, 0), torch.float32).backend == "triton"
        dispatch.gram(torch.ones(2, 5))
        assert calls == [torch.Size([2, 5])]
    finally:
        dispatch.unregister_backend("gram", "mine")
    assert dispatch.decide("gram", None, torch.float32).backend == "reference"
    with pytest.raises(ValueError, match="built-in"):
        dispatch.register_backend("gram", "triton", lambda c, d: None, my_gram)


def test_the_per_op_override(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.setenv(dispatch.KERNELS_ENV, "pal=sdpa, gram=reference")
    assert dispatch.backend("pal", x) == "sdpa" and dispatch.backend("gram", x) == "reference"
    monkeypatch.setenv(dispatch.KERNELS_ENV, "reference,pal=sdpa")
    assert dispatch.backend("pal", x) == "sdpa" and dispatch.backend("combine", x) == "reference"
    monkeypatch.setenv(dispatch.KERNELS_ENV, "pal=nope")
    with pytest.raises(ValueError, match="names no backend"):
        dispatch.backend("pal", x)
    monkeypatch.setenv(dispatch.KERNELS_ENV, "softmax=sdpa")
    with pytest.raises(ValueError, match="op=backend"):
        dispatch.backend("pal", x)
    monkeypatch.setenv(dispatch.KERNELS_ENV, "auto,reference")
    with pytest.raises(ValueError, match="more than one mode"):
        dispatch.backend("pal", x)


def test_the_old_variables_still_work_with_a_deprecation_warning(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.delenv(dispatch.KERNELS_ENV, raising=False)
    monkeypatch.setattr(backends, "_WARNED", set())
    monkeypatch.setenv(dispatch.BACKENDS_ENV, "pal=sdpa")
    with pytest.warns(FutureWarning, match="FASTPALS_BACKENDS is deprecated"):
        assert dispatch.backend("pal", x) == "sdpa"
    monkeypatch.setenv(dispatch.OPS_ENV, "library")
    with pytest.warns(FutureWarning, match="FASTPALS_OPS is deprecated"):
        assert backends.switch().library


# ------------------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------------------
def _packed_step():
    sys.path.insert(0, str(ROOT / "tests"))
    from test_batching import PAL, _model, _per_task_batches

    from fastpals.data.mixed_batches import model_inputs, pack_batches

    model = _model(PAL, "sbert_concat").eval()  # dropout off: compiled and eager draw no masks
    batches = _per_task_batches(model, sizes=(2, 3, 2), seed=7)
    ids = sorted(batches)
    batch = pack_batches([batches[t] for t in ids], ids, 3)
    inputs, labels = model_inputs(batch, "cpu"), batch["labels"]

    def loss() -> torch.Tensor:
        return model.task_losses(model(**inputs), labels, weighting="equal").total

    return model, loss


def _compiled_matches_eager(model: torch.nn.Module, loss, eager_env: dict[str, str] | None = None) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = compiled()
    got_grads = torch.autograd.grad(got, params, allow_unused=True)
    saved = {k: os.environ.pop(k, None) for k in (eager_env or {})}
    try:
        want = loss()
        want_grads = torch.autograd.grad(want, params, allow_unused=True)
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_packed_multitask_forward_and_losses_have_no_graph_break():
    torch._dynamo.reset()
    _, loss = _packed_step()
    explained = torch._dynamo.explain(loss)()
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_fullgraph_compile_of_the_packed_step_matches_eager():
    torch._dynamo.reset()
    model, loss = _packed_step()
    _compiled_matches_eager(model, loss)


def test_fullgraph_compile_through_the_custom_ops_matches_the_eager_reference(monkeypatch):
    """``$FASTPALS_KERNELS=auto,library`` sends the PALs and the attention through torch.ops.fastpals (what a GPU
    compiles)."""
    torch._dynamo.reset()
    model, loss = _packed_step()
    monkeypatch.setenv(dispatch.KERNELS_ENV, "auto,library")
    explained = torch._dynamo.explain(loss)()
    assert explained.graph_break_count == 0
    ops = {str(n.target) for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"}
    for name in ("fastpals.pal_varlen", "fastpals.attention_varlen"):
        assert any(t.startswith(name) for t in ops), (name, sorted(ops))
    torch._dynamo.reset()
    _compiled_matches_eager(model, loss, eager_env={dispatch.KERNELS_ENV: "auto,library"})


def test_fullgraph_compile_of_an_hf_bert_with_injected_pals_matches_eager():
    transformers = pytest.importorskip("transformers")
    from fastpals import PALConfig, inject_pals

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = inject_pals(
        transformers.BertModel(cfg), PALConfig(num_tasks=3, hidden=12, num_heads=2, gate=True, dropout=0.0)
    ).train()
    ids = torch.randint(1, 97, (4, 9))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    task_ids = torch.tensor([0, 2, 1, 0])

    def loss() -> torch.Tensor:
        out = model(input_ids=ids, attention_mask=mask, task_ids=task_ids).last_hidden_state
        return (out * mask[..., None]).square().mean()

    explained = torch._dynamo.explain(loss)()
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    torch._dynamo.reset()
    _compiled_matches_eager(model, loss)


@pytest.mark.gpu
@requires_cuda  # the ops' CUDA kernels (Triton)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_op_passes_opcheck_on_cuda(dtype):
    from fastpals_kernels.common import build_task_row_plan

    h, mask, task_ids, weights, g = _pal_operands(dtype)
    on_device = [t.detach().to(DEVICE).requires_grad_(t.requires_grad) for t in (h, *weights)]
    h, weights = on_device[0], on_device[1:]
    mask, task_ids = mask.to(DEVICE), task_ids.to(DEVICE)
    seed = library.draw_seed()
    opcheck(torch.ops.fastpals.pal.default, (h, mask, task_ids, *weights, HEADS, True, 0.0, None, seed))
    cu = torch.tensor([0, 7, 11, 18, 20], device=DEVICE, dtype=torch.int32)
    rows = torch.randn(20, D, device=DEVICE, dtype=dtype, requires_grad=True)
    opcheck(
        torch.ops.fastpals.pal_varlen.default, (rows, cu, 7, task_ids, *weights, HEADS, True, 0.0, None, seed)
    )
    q, k, v = (torch.randn(20, 2, 8, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(3))
    opcheck(torch.ops.fastpals.attention_varlen.default, (q, k, v, cu, 7, 0.0, seed))
    dy, x = torch.randn(20, 6, device=DEVICE, dtype=dtype), torch.randn(20, 5, device=DEVICE, dtype=dtype)
    plan = build_task_row_plan(task_ids, T, 20, cu_seqlens=cu)
    opcheck(torch.ops.fastpals.grouped_wgrad.default, (dy, x, plan.row_index, plan.task_row_offsets, plan.tile_task,
            plan.tile_start, plan.tile_end, T, plan.block_rows, True, torch.float32))  # fmt: skip
    # fp32 rows, as the surgery buffer's
    dw, db = torch.zeros(T, 6, 5, device=DEVICE), torch.zeros(T, 6, device=DEVICE)
    opcheck(torch.ops.fastpals.grouped_wgrad_out.default, (dy, x, plan.row_index, plan.task_row_offsets,
            plan.tile_task, plan.tile_start, plan.tile_end, T, plan.block_rows, dw, db))  # fmt: skip
    # one streamed Linear with a bias, called twice
    calls = ([dy, dy], [x, x], [plan.row_index] * 2, [plan.task_row_offsets] * 2, [0, 0], [True])
    opcheck(torch.ops.fastpals.stream_linear_gram.default, (*calls, T))
    opcheck(torch.ops.fastpals.stream_linear_combine.default, (*calls, torch.rand(T, device=DEVICE)))
    buf = torch.randn(3, 4099, device=DEVICE, dtype=dtype)
    w = torch.randn(3, device=DEVICE)
    opcheck(torch.ops.fastpals.gram.default, (buf,))
    opcheck(torch.ops.fastpals.combine.default, (buf, w))
    opcheck(torch.ops.fastpals.combine_out.default, (buf, w, torch.empty(4099, device=DEVICE)))
    opcheck(torch.ops.fastpals.combine_row.default, (buf.clone(), w, 0))
    res = torch.randn_like(rows, requires_grad=True)
    ln_w, ln_b = (torch.randn(D, device=DEVICE, requires_grad=True) for _ in range(2))
    opcheck(
        torch.ops.fastpals.dropout_add_layer_norm.default,
        (rows, res, None, ln_w, ln_b, 1e-12, 0.1, seed, dtype),
    )
