"""``fastpals.integrations.transformers.MultiTaskTrainer``: one update of the Hugging Face Trainer equals the
update of fastpals' own trainer (:func:`fastpals.train.step.run_update`, strategy ``one_backward``, on the
micro-batch fastpals' ``--batching mixed`` sampler draws with the same seed), within 1e-6 in fp32, for SGD (the
update is the aggregated gradient itself) and AdamW; and the shortened example runs."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fastpals.data.loading import load_task  # noqa: E402
from fastpals.data.per_task_batches import TaskBatcher  # noqa: E402
from fastpals.data.tokenizer import Tokenizer  # noqa: E402
from fastpals.encoder.bert import PALConfig  # noqa: E402
from fastpals.model.multitask import MultiTaskBert  # noqa: E402
from fastpals.surgery import TaskGradientBuffer, make_weighting, shared_parameters_by_name  # noqa: E402
from fastpals.train.data_setup import MixedUpdates, packed_micro_batches  # noqa: E402
from fastpals.train.step import Surgery, TorchEngine, run_update  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_fixtures import make_tiny_data, make_tiny_model  # noqa: E402

TASKS = ("sst", "sts")
SEED = 3
BATCH = 12


@pytest.fixture(autouse=True)
def _one_plain_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier in-process fastpals run (train.py's ``main``) leaves the launcher variables DeepSpeed reads
    (``LOCAL_RANK``, ``WORLD_SIZE``, ...) in ``os.environ``; accelerate would read them as a 1-rank distributed run
    and wrap the model in DDP. A user's own Trainer process starts without them."""
    from accelerate.state import AcceleratorState, PartialState

    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    AcceleratorState._reset_state(True)
    PartialState._reset_state()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hf_trainer")
    data = make_tiny_data(root / "data", n=32)
    model = make_tiny_model(root / "model")
    config = json.loads((model / "config.json").read_text())
    # no dropout: the two runs share no random stream
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (model / "config.json").write_text(json.dumps(config))
    return data, model


def _batchers(data: Path, model_dir: Path) -> list[TaskBatcher]:
    tokenizer = Tokenizer.from_pretrained(str(model_dir))
    return [
        TaskBatcher(load_task(t, "train", data), tokenizer, t, BATCH, max_length=24, seed=SEED * 1000 + i)
        for i, t in enumerate(TASKS)
    ]


def _model(model_dir: Path) -> MultiTaskBert:
    torch.manual_seed(0)
    pal = PALConfig(hidden=16, num_heads=2)
    return MultiTaskBert.from_base(str(model_dir), list(TASKS), pal, head_dropout=0.0).train()


def _hf_update(
    model: MultiTaskBert,
    batchers: list[TaskBatcher],
    optim: str,
    out: Path,
    surgery: str,
    accumulation: int = 1,
) -> dict:
    from fastpals.integrations.transformers import MultiTaskTrainer

    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=1, per_device_train_batch_size=BATCH, learning_rate=1e-2,
        weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant", optim=optim, seed=SEED,
        report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", disable_tqdm=True,
        gradient_accumulation_steps=accumulation,
    )  # fmt: skip
    trainer = MultiTaskTrainer(model, args, dict(zip(TASKS, batchers)), sampling="annealed", surgery=surgery)
    first = next(iter(trainer.get_train_dataloader()))
    trainer.train()
    return first


def _fastpals_update(model: MultiTaskBert, batchers: list[TaskBatcher], optimizer: torch.optim.Optimizer,
                     surgery: str, accumulation: int = 1) -> dict:  # fmt: skip
    """run_update over the first update of fastpals' mixed sampler (``accumulation`` micro-batches, each loss
    divided by their number, as DeepSpeed's and the Trainer's backward do)."""
    sampler = MixedUpdates(batchers, "annealed", 1, BATCH, None, accumulation, None, SEED)
    micro_batches = list(packed_micro_batches(batchers, sampler.next_update(), "cpu", "examples"))
    shared, specific = shared_parameters_by_name(model)
    aggregator = Surgery(
        TaskGradientBuffer(shared, len(TASKS), task_params=specific), make_weighting(surgery)[0],
        torch.Generator().manual_seed(SEED),
    )  # fmt: skip
    hooks = [lambda step, loss: loss / accumulation] if accumulation > 1 else []
    run_update(
        TorchEngine(model, optimizer), micro_batches, "one_backward", surgery=aggregator, loss_hooks=hooks
    )
    return micro_batches[0].inputs


@pytest.mark.parametrize(
    ("optim", "surgery", "accumulation"),
    [("sgd", "pcgrad", 1), ("adamw_torch", "pcgrad", 1), ("sgd", "mgda", 2)],
)
def test_one_update_equals_fastpals_trainer(
    tiny: tuple[Path, Path], tmp_path: Path, optim: str, surgery: str, accumulation: int
) -> None:
    data, model_dir = tiny
    start = _model(model_dir)
    ours = copy.deepcopy(start)
    hf = copy.deepcopy(start)
    first = _hf_update(hf, _batchers(data, model_dir), optim, tmp_path / "hf", surgery, accumulation)
    if optim == "sgd":
        opt = torch.optim.SGD(ours.parameters(), lr=1e-2)
    else:
        opt = torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.0)
    inputs = _fastpals_update(ours, _batchers(data, model_dir), opt, surgery, accumulation)
    # the same micro-batch: both tasks present, the same tokens
    assert torch.equal(first["input_ids"], inputs["input_ids"])
    assert torch.equal(first["layout"].task_ids, inputs["layout"].task_ids)
    assert set(first["layout"].present) == {0, 1}
    moved = 0.0
    for (name, p), q, p0 in zip(hf.named_parameters(), ours.parameters(), start.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        moved = max(moved, (p - p0).abs().max().item())
    assert moved > 1e-4  # the step changed the weights

    if surgery == "mgda":  # the aggregator acts: MGDA's update is not the plain sum of the task gradients
        plain = copy.deepcopy(start)
        sgd = torch.optim.SGD(plain.parameters(), lr=1e-2)
        _fastpals_update(plain, _batchers(data, model_dir), sgd, "sum", accumulation)
        gap = max((p - q).abs().max().item() for p, q in zip(hf.parameters(), plain.parameters()))
        assert gap > 1e-5


def test_a_non_finite_task_gradient_changes_nothing(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """A NaN in sts's head makes its task gradient non-finite: the surgery skips, the step leaves every weight."""
    from fastpals.integrations.transformers import MultiTaskTrainer

    data, model_dir = tiny
    model = _model(model_dir)
    with torch.no_grad():
        model.heads["sts"].out.bias.fill_(float("nan"))
    start = copy.deepcopy(model)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=BATCH, learning_rate=1e-2, optim="sgd",
        max_grad_norm=1.0, seed=SEED, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = MultiTaskTrainer(model, args, _batchers(data, model_dir), surgery="pcgrad")
    trainer.train()
    assert trainer.last_surgery.skipped and trainer.last_surgery.nonfinite_tasks == [1]
    for (name, p), q in zip(model.named_parameters(), start.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}")


def test_bad_batchers_are_refused(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    from fastpals.integrations.transformers import MultiTaskTrainer

    data, model_dir = tiny
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    batchers = _batchers(data, model_dir)
    with pytest.raises(ValueError, match=r"train_batchers has tasks \['sst'\], the model \['sst', 'sts'\]"):
        MultiTaskTrainer(_model(model_dir), args, {"sst": batchers[0]})
    with pytest.raises(ValueError, match="unknown surgery method 'pcgard'"):
        MultiTaskTrainer(_model(model_dir), args, batchers, surgery="pcgard")


def test_example_runs_shortened(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """examples/hf_trainer_multitask.py, in this process (transformers is imported already), on the tiny model."""
    data, model_dir = tiny
    spec = importlib.util.spec_from_file_location(
        "hf_trainer_multitask", ROOT / "examples" / "hf_trainer_multitask.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    scores = example.main(
        ["--model", str(model_dir), "--data-dir", str(data), "--out", str(tmp_path / "run"), "--max-steps", "3",
         "--max-train", "32", "--max-eval", "16", "--pal-hidden", "16", "--pal-heads", "2", "--batch-size", "8"]
    )  # fmt: skip
    assert set(scores) == {"sst", "sts", "overall"}
    assert json.loads((tmp_path / "run" / "dev_scores.json").read_text()) == pytest.approx(
        scores, nan_ok=True
    )
    assert MultiTaskBert.from_pretrained(tmp_path / "run" / "model").task_names == list(TASKS)
