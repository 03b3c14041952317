"""``fastpals.train.step.run_update``, the one update of the trainer and the benchmarks: each strategy (none,
per_task_backward, one_backward; per-task and mixed micro-batches) reads device values on the host once per
update from ``fastpals/train/`` (with surgery on one rank, ``buffer.apply``'s flags join that read), a NaN loss stops the update
before ``engine.step()``, and a skipped surgery update does not step. In-process on a tiny model with
:class:`~fastpals.train.step.TorchEngine`, and through ``Trainer.train_update`` under DeepSpeed in a subprocess
(so that no process group leaks into the test session)."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastpals.data.mixed_batches import model_inputs, pack_batches
from fastpals.encoder.bert import BertConfig, PALConfig
from fastpals.model.multitask import MultiTaskBert, MultiTaskConfig, get_task
from fastpals.train.errors import NonFiniteLossError
from fastpals.train.step import MicroBatch, Surgery, TorchEngine, run_update

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_read_counter import READS, HostReads  # noqa: E402
from train_fixtures import make_tiny_data, make_tiny_model  # noqa: E402

TRAIN = "/fastpals/train/"


def _model(seed: int = 0) -> MultiTaskBert:
    torch.manual_seed(seed)
    bert = BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    tasks = [get_task(t) for t in ("sst", "para", "sts")]
    return MultiTaskBert(MultiTaskConfig(bert, tasks, PALConfig(hidden=16, num_heads=2))).train()


def _task_batch(t: int, rows: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    lengths = torch.randint(4, 9, (rows,), generator=generator)
    mask = (torch.arange(8)[None, :] < lengths[:, None]).long()
    ids = torch.randint(5, 50, (rows, 8), generator=generator) * mask
    labels = [
        torch.randint(0, 5, (rows,), generator=generator).float(),
        torch.randint(0, 2, (rows,), generator=generator).float(),
        torch.rand(rows, generator=generator) * 5,
    ][t]
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "token_type_ids": torch.zeros_like(ids),
        "labels": labels,
    }


def _micro_batches(batching: str, generator: torch.Generator) -> list[MicroBatch]:
    """Two per-task micro-batches of every task, or two packed mixed micro-batches of all three tasks."""
    if batching == "per_task":
        out = []
        for t in (0, 1, 2, 0, 1, 2):
            b = _task_batch(t, 4, generator)
            inputs = {k: b[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
            inputs["task_ids"] = torch.full((4,), t, dtype=torch.long)
            out.append(MicroBatch(inputs, b["labels"], (t,), (4,)))
        return out
    out = []
    for _ in range(2):
        batches = [_task_batch(t, 3, generator) for t in range(3)]
        packed = pack_batches(batches, [0, 1, 2], 3)
        tokens = tuple(int(b["attention_mask"].sum()) for b in batches)
        out.append(
            MicroBatch(
                model_inputs(packed, "cpu"), packed["labels"], (0, 1, 2), (3, 3, 3), tokens, "examples"
            )
        )
    return out


def _surgery(model: MultiTaskBert) -> Surgery:
    from fastpals.surgery import TaskGradientBuffer, pcgrad_weights, shared_parameters_by_name

    shared, specific = shared_parameters_by_name(model)
    return Surgery(TaskGradientBuffer(shared, 3, task_params=specific), pcgrad_weights, torch.Generator())


CASES = [
    ("none", "per_task"),
    ("none", "mixed"),
    ("per_task_backward", "per_task"),
    ("one_backward", "mixed"),
]


@pytest.mark.parametrize("strategy, batching", CASES)
def test_an_update_reads_the_device_once(strategy, batching):
    model = _model()
    accumulation = (6 if batching == "per_task" else 2) if strategy == "none" else 1
    engine = TorchEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), accumulation=accumulation)
    surgery = None if strategy == "none" else _surgery(model)
    gen = torch.Generator().manual_seed(0)
    for k in range(2):  # the second update is counted (the first allocates optimizer state and buffers)
        micro = _micro_batches(batching, gen)  # collated on the host beforehand: not counted
        with HostReads(READS) as reads:
            reads.active = k == 1
            update = run_update(engine, micro, strategy, surgery=surgery)
            reads.active = False
    mine = reads.under(TRAIN)
    assert sum(mine.values()) == 1 and list(mine)[0].endswith(" tolist"), mine
    if (
        surgery is not None
    ):  # one rank: apply's finite flags are read with the losses, the buffer reads nothing
        assert sum(reads.under("/fastpals/surgery/buffer.py").values()) == 0, reads.under("/fastpals/")
    assert update.stepped and set(update.loss) == {"sst", "para", "sts"}
    assert update.examples == (
        {"sst": 8, "para": 8, "sts": 8} if batching == "per_task" else {"sst": 6, "para": 6, "sts": 6}
    )
    assert (update.tokens is None) == (batching == "per_task")


@pytest.mark.parametrize("strategy, batching", CASES)
def test_a_nan_loss_stops_the_update_before_the_step(strategy, batching):
    """The NaN of micro-batch 2 (a hook, as the trainer's fault injection) is recorded and raised after the
    update's backwards, naming the micro-batch's tasks, and nothing is applied."""
    model = _model()
    accumulation = (6 if batching == "per_task" else 2) if strategy == "none" else 1
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation=accumulation)
    surgery = None if strategy == "none" else _surgery(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = []

    def nan_second(step, loss):
        seen.append(step)
        return loss * float("nan") if len(seen) == 2 else loss

    records = []
    micro = _micro_batches(batching, torch.Generator().manual_seed(1))
    with pytest.raises(NonFiniteLossError, match="non-finite loss nan at update step 7") as info:
        run_update(
            engine, micro, strategy, surgery=surgery, step=7, loss_hooks=[nan_second], record=records.append
        )
    assert seen == [7] * len(micro)  # every backward ran; the check is after the last one
    assert engine.micro_steps == (len(micro) - 1 if strategy == "none" else 0)  # not the boundary's step
    want = "para" if batching == "per_task" else "sst,para,sts"
    assert info.value.task == want and records == [
        {"type": "nonfinite", "step": 7, "task": want, "loss": info.value.value}
    ]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing was stepped


def test_a_non_finite_task_gradient_skips_the_step():
    model = _model()
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.1))
    surgery = _surgery(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    micro = _micro_batches("per_task", torch.Generator().manual_seed(2))[:3]

    def inf_grad(grad):
        return torch.full_like(grad, float("inf"))

    handle = model.bert.encoder.layer[0].attention.self.query.weight.register_hook(inf_grad)
    try:
        update = run_update(engine, micro, "per_task_backward", surgery=surgery)
    finally:
        handle.remove()
    assert not update.stepped and update.surgery.skipped and update.surgery.nonfinite_tasks == [0, 1, 2]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_bad_descriptions_are_refused():
    model = _model()
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match="strategy must be one of"):
        run_update(engine, _micro_batches("per_task", gen), "pcgrad")
    with pytest.raises(ValueError, match="needs a surgery"):
        run_update(engine, _micro_batches("per_task", gen), "per_task_backward")
    with pytest.raises(ValueError, match="one-task micro-batches"):
        run_update(engine, _micro_batches("mixed", gen), "per_task_backward", surgery=_surgery(model))
    with pytest.raises(ValueError, match="give them a weighting"):
        run_update(engine, _micro_batches("per_task", gen), "one_backward", surgery=_surgery(model))
    with pytest.raises(ValueError, match="at least one micro-batch"):
        run_update(engine, [], "none")


TRAINER_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[4])
from host_read_counter import READS, HostReads
from fastpals.train.command import parse_args
from fastpals.train.loop import Trainer

model, data, out = sys.argv[1], sys.argv[2], sys.argv[3]
common = ["--model", model, "--data-dir", data, "--batch-size", "4", "--max-length", "16", "--pal-hidden", "16",
          "--pal-heads", "2", "--max-eval", "4", "--no-progress", "--epochs", "1", "--steps-per-epoch", "4",
          "--lr", "1e-3", "--ds_config", "configs/cpu_fp32.json"]
configs = {"per_task/none": ["--batching", "per_task", "--grad-accum", "3"],
           "mixed/none": ["--batching", "mixed", "--grad-accum", "2"],
           "per_task/per_task_backward": ["--batching", "per_task", "--surgery", "pcgrad", "--sampling",
                                          "random_round_robin"],
           "mixed/one_backward": ["--batching", "mixed", "--surgery", "pcgrad", "--pair-mode", "sbert_concat"],
           "mixed/one_backward_stream": ["--batching", "mixed", "--surgery", "pcgrad", "--pair-mode",
                                         "sbert_concat", "--surgery-memory", "stream"]}
result = {}
with HostReads(READS) as reads:
    for name, extra in configs.items():
        tr = Trainer(parse_args([*common, *extra, "--out", f"{out}/{name.replace('/', '_')}"]), callbacks=[])
        tr._setup_data(); tr._setup_model(); tr._setup_engine(); tr.engine.train()
        tr.train_update(tr.sampler.next_update())
        group = tr.sampler.next_update()
        reads.counts.clear()
        reads.active = True
        stats = tr.train_update(group)
        reads.active = False
        result[name] = {"micro_batches": len(group), "train": reads.under("/fastpals/train/"),
                        "buffer": sum(reads.under("/fastpals/surgery/buffer.py").values())
                        + sum(reads.under("/fastpals/surgery/stream.py").values()), "stats": stats}
        if name.startswith("mixed"):  # the host counts equal what the collated batches count
            from fastpals.data.mixed_batches import collate_packed
            batchers = list(tr.train_batchers.values())
            layouts = [collate_packed(batchers, sel)["layout"] for sel in group]
            passes = [p for lay in layouts for p in (lay, lay.second) if p is not None]
            result[name]["collated"] = {
                "task_examples": {t: sum(lay.task_examples[i] for lay in layouts)
                                  for i, t in enumerate(tr.args.task_list)},
                "task_tokens": {t: sum(p.task_tokens[i] for p in passes) for i, t in enumerate(tr.args.task_list)}}
print("RESULT " + json.dumps(result))
"""


@pytest.mark.slow
def test_trainer_updates_read_the_device_once(tmp_path):
    """``Trainer.train_update`` under DeepSpeed (ZeRO-0 fp32 on CPU), per-task and mixed batches (siamese pairs
    in the one-backward case), with and without PCGrad: one read from ``fastpals/train/`` per update (of 1 to 3
    micro-batches), none in ``buffer.apply`` (one rank); the mixed updates' host counts of examples and tokens equal the collated
    batches' counts."""
    data, model = make_tiny_data(tmp_path / "data"), make_tiny_model(tmp_path / "model")
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env["FASTPALS_DATA_DIR"] = str(data)
    proc = subprocess.run(
        [sys.executable, "-c", TRAINER_SCRIPT, str(model), str(data), str(tmp_path / "runs"), str(ROOT / "tests")],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    for name, r in result.items():
        assert r["micro_batches"] >= (1 if name.startswith("mixed/one_backward") else 2), (name, r)
        assert sum(r["train"].values()) == 1, (name, r)
        assert r["buffer"] == 0, (name, r)  # one rank: apply's flags are read with the update's losses
        assert set(r["stats"]["loss"]) <= {"sst", "para", "sts"} and r["stats"]["examples"] > 0, (name, r)
        if name.startswith("mixed"):
            assert r["stats"]["tokens"] == sum(r["stats"]["task_tokens"].values()) > 0, (name, r)
            for key in ("task_examples", "task_tokens"):
                want = {t: n for t, n in r["collated"][key].items() if n}
                assert r["stats"][key] == want, (name, key, r)


def test_counter_sees_reads_from_this_file():
    """The counter itself: reads made here are attributed to this file, none to fastpals/train."""
    with HostReads(READS) as reads:
        reads.active = True
        t = torch.tensor([1.5, 2.0])
        t.tolist(), float(t[0]), int(t[1]), bool(t[0]), t.sum().item()
        reads.active = False
    here = reads.under("/tests/")
    assert sum(here.values()) == 5 and not reads.under(TRAIN), here
    assert collections.Counter(k.split()[-1] for k in here) == collections.Counter(
        {"tolist": 1, "__float__": 1, "__int__": 1, "__bool__": 1, "item": 1}
    )
