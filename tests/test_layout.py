"""The batch layout: built once on the host from token lengths, validated there, and the one source of every
row map (task ranges, cu_seqlens, positions) the model and the per-task gradients use."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from device import DEVICE, requires_cuda

from fastpals.data.layout import BatchLayout
from fastpals.data.mixed_batches import TaskRows, model_inputs, pack_batches, pack_task_rows
from fastpals_kernels.padding import cu_seqlens_to_mask, lengths_to_cu_seqlens, packed_position_ids


def test_from_lengths_host_values_and_device_tensors_agree():
    lengths, tasks = [3, 1, 4, 2, 5], [0, 0, 1, 2, 2]
    lay = BatchLayout.from_lengths(lengths, tasks, 3)
    cu = lengths_to_cu_seqlens(torch.tensor(lengths))
    assert torch.equal(lay.cu_seqlens, cu) and lay.cu_seqlens.dtype == torch.int32
    assert lay.cu_host.tolist() == cu.tolist() and lay.total == 15 and lay.max_seqlen == 5
    assert torch.equal(lay.position_ids, packed_position_ids(cu, 15))
    assert lay.task_examples == [2, 1, 2] and lay.task_tokens == [4, 4, 7] and lay.present == [0, 1, 2]
    assert lay.example_ranges == {0: (0, 2), 1: (2, 3), 2: (3, 5)}
    assert lay.token_ranges == {0: (0, 4), 1: (4, 8), 2: (8, 15)}
    assert lay.task_segments(3) == [4, 4, 7]
    assert torch.equal(lay.row_task_ids, torch.tensor(tasks).repeat_interleave(torch.tensor(lengths)))
    assert torch.equal(lay.cls_index, cu[:-1].long())
    assert torch.equal(lay.padding_mask(), cu_seqlens_to_mask(cu, 5))
    x = torch.randn(15, 2)
    assert torch.equal(lay.to_rows(lay.to_padded(x)), x)


def test_ungrouped_rows_have_index_maps_and_no_segments():
    lay = BatchLayout.from_lengths([2, 3, 1], [1, 0, 1], 2)
    assert lay.example_ranges is None and lay.token_ranges is None and lay.task_segments(2) is None
    assert torch.equal(lay.rows_of(1), torch.tensor([0, 2]))


@pytest.mark.parametrize(
    "lengths, tasks, match",
    [([], [], "at least one sequence"), ([2, 0], [0, 0], "at least one token"), ([2, 2], [0, 3], "outside"),
     ([2, 2], [0], "entries")],
)  # fmt: skip
def test_from_lengths_validates_once_on_the_host(lengths, tasks, match):
    with pytest.raises(ValueError, match=match):
        BatchLayout.from_lengths(lengths, tasks, 3)


def test_packing_from_token_lists_equals_packing_padded_batches():
    """Collate's direct packing (no pad-then-unpad) gives the tensors and layout of the padded route."""
    rng = np.random.default_rng(0)
    parts, padded = [], []
    for t, n in ((0, 2), (2, 3)):
        ids = [list(rng.integers(5, 50, size=k)) for k in rng.integers(2, 7, size=n)]
        parts.append(
            TaskRows(t, ids, [[0] * len(x) for x in ids], labels=torch.arange(n, dtype=torch.float32))
        )
        width = max(len(x) for x in ids)
        padded.append({
            "input_ids": torch.tensor([x + [0] * (width - len(x)) for x in ids]),
            "token_type_ids": torch.zeros(n, width, dtype=torch.long),
            "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids]),
            "labels": torch.arange(n, dtype=torch.float32),
        })  # fmt: skip
    a = pack_task_rows(parts, 3)
    b = pack_batches(padded, [0, 2], 3)
    assert a.keys() == b.keys() == {"input_ids", "token_type_ids", "labels", "ids", "tasks", "layout"}
    for key in ("input_ids", "token_type_ids", "labels"):
        assert torch.equal(a[key], b[key]), key
    la, lb = a["layout"], b["layout"]
    assert torch.equal(la.cu_seqlens, lb.cu_seqlens) and torch.equal(la.task_ids, lb.task_ids)
    assert la.token_ranges == lb.token_ranges and la.task_tokens == lb.task_tokens
    assert model_inputs(a, "cpu").keys() == {"input_ids", "token_type_ids", "layout"}


def test_per_task_gradients_takes_the_layout_and_task_ids_only_with_a_warning():
    """The block gets the batch's layout as an argument. Task ids (the old call) still give the same per-task
    gradients with a DeprecationWarning: the layout's own tensors (``model_inputs(...)["task_ids"]``, as the
    host-read probe passes them) name the layout the model's forward gets, with no host read; other tensors are
    read on the host."""
    sys.path.insert(0, str(Path(__file__).parent))
    from host_read_counter import HostReads
    from test_fake_step import TASKS, _batch, _tiny_model

    from fastpals.surgery import TaskGradientBuffer, per_task_gradients, shared_parameters_by_name

    torch.manual_seed(0)
    model = _tiny_model().eval()
    batch = _batch()
    inputs = model_inputs(batch, "cpu")
    layout = inputs["layout"]
    assert "task_ids" not in inputs and "cu_seqlens" not in inputs  # model(**inputs) gets the layout alone
    with pytest.warns(DeprecationWarning, match=r"\['layout'\]"):
        own = (inputs["task_ids"], inputs["cu_seqlens"])
    assert own[0] is layout.task_ids and own[1] is layout.cu_seqlens
    shared, specific = shared_parameters_by_name(model)
    rows, reads = [], []
    for args in ((layout,), own, (own[0].clone(), own[1].clone())):
        buf = TaskGradientBuffer(shared, len(TASKS), task_params=specific)
        with warnings.catch_warnings(record=True) as caught, HostReads() as counter:
            warnings.simplefilter("always")
            counter.active = True
            with per_task_gradients(model, buf, *args):  # the model's forward reads nothing on the host
                res = model.task_losses(model(**inputs), batch["labels"], weighting="equal")
                sum(res.per_task.values()).backward()
        old = len(args) > 1
        assert [w.category for w in caught if "BatchLayout" in str(w.message)] == [DeprecationWarning] * old
        reads.append(sum(n for (path, *_), n in counter.counts.items() if "/fastpals/" in path))
        rows.append(torch.stack([buf.row(t) for t in range(len(TASKS))]))
    assert rows[0].abs().sum() > 0 and torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])
    assert reads[:2] == [0, 0] and reads[2] > 0, reads


def test_model_does_not_import_batching_or_data_modules():
    """In the import graph lint-imports reads: the packages' ``__init__`` import every module, so a run's
    ``sys.modules`` cannot show this."""
    grimp = pytest.importorskip("grimp", reason="grimp comes with import-linter (the dev extra)")
    graph = grimp.build_graph("fastpals", "fastpals_kernels", exclude_type_checking_imports=True)
    chains = [
        graph.find_shortest_chain(importer=model, imported=data)
        for model in ("fastpals.encoder.bert", "fastpals.model.multitask")
        for data in ("fastpals.data.mixed_batches", "fastpals.data.per_task_batches", "fastpals.data.loading",
                     "fastpals.data.readers")
    ]  # fmt: skip
    assert chains == [None] * len(chains), [c for c in chains if c]


@pytest.mark.gpu
@requires_cuda  # torch.cuda.set_sync_debug_mode
@pytest.mark.parametrize("surgery", [None, "pcgrad", "gem", "mgda", "upgrad"])
def test_gpu_step_under_sync_debug_mode_error(surgery):
    """On a GPU the same packed mixed-task step as tests/test_fake_step.py runs with synchronisations made
    errors (``torch.cuda.set_sync_debug_mode("error")``): any host read inside the step raises."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_fake_step import TASKS, _batch, _tiny_model

    from fastpals.surgery import (
        AGGREGATORS,
        TaskGradientBuffer,
        per_task_gradients,
        shared_parameters_by_name,
    )

    torch.manual_seed(0)
    model = _tiny_model().to(DEVICE)
    batch = _batch()
    inputs = model_inputs(batch, DEVICE)
    labels = batch["labels"].to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    shared, specific = shared_parameters_by_name(model)
    buf = TaskGradientBuffer(shared, len(TASKS), task_params=specific)
    for warm in (True, False):  # the first step builds caches (allowed to sync); the second must not
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(0 if warm else "error")
        try:
            opt.zero_grad(set_to_none=True)
            if surgery is None:
                model.task_losses(model(**inputs), labels, weighting="equal").total.backward()
            else:
                with per_task_gradients(model, buf, inputs["layout"]):
                    res = model.task_losses(model(**inputs), labels, weighting="equal")
                    sum(res.per_task.values()).backward()
                buf.apply(AGGREGATORS[surgery], generator=torch.Generator().manual_seed(0), sync=False)
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)


def test_no_import_circle_between_the_per_task_gradient_modules():
    """per_task.py imports layer_grads.py; layer_grads.py imports nothing of per_task (not even for types)."""
    import ast

    root = Path(__file__).resolve().parents[1] / "fastpals" / "surgery"
    tree = ast.parse((root / "layer_grads.py").read_text())
    names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in names if m.startswith("fastpals.surgery")], names
