"""``--surgery-memory auto``: the decision (``fastpals.train.memory_mode``), the planner's per-GPU pick and the
trainer's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastpals.train.memory_mode import (
    FIT_SHARE,
    KEEP_SHARE,
    choose_memory_mode,
    estimate_activation_bytes,
    keep_bytes,
    plan_auto_modes,
    run_memory_mode,
)

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def test_the_buffer_where_it_fits_and_its_rows_are_small():
    choice = choose_memory_mode(100 * MIB, 400 * MIB, 2000 * MIB, 16000 * MIB)
    assert choice.mode == "buffer" and "fits" in choice.why


def test_streaming_where_the_buffer_does_not_fit():
    # rows small beside the activations, but the buffer's peak is over the margin of the device
    choice = choose_memory_mode(100 * MIB, 400 * MIB, 15000 * MIB, 16000 * MIB)
    assert choice.mode == "stream" and "over 90% of the device" in choice.why
    # the same step on a device with room: the buffer; exactly at the margin: still the buffer
    assert choose_memory_mode(100 * MIB, 400 * MIB, 15000 * MIB, 80000 * MIB).mode == "buffer"
    assert choose_memory_mode(100 * MIB, 400 * MIB, int(FIT_SHARE * 1000 * MIB), 1000 * MIB).mode == "buffer"


def test_streaming_where_the_rows_dominate():
    choice = choose_memory_mode(500 * MIB, 400 * MIB, 2000 * MIB, 80000 * MIB)
    assert choice.mode == "stream" and "rows" in choice.why and "activations" in choice.why
    # an unknown device (0 bytes) checks the rows alone
    assert choose_memory_mode(100 * MIB, 400 * MIB, 10**15, 0).mode == "buffer"


def test_auto_streaming_keeps_the_first_layers_rows_within_a_share_of_the_activations():
    """``auto``'s streaming budget of kept Linear rows: KEEP_SHARE of the activations, named in the set-up line;
    none for the buffer, none when asked (data parallel), none from the trainer's rule with 2 ranks."""
    choice = choose_memory_mode(500 * MIB, 400 * MIB, 2000 * MIB, 80000 * MIB)
    assert choice.keep_bytes == keep_bytes(400 * MIB) == int(KEEP_SHARE * 400 * MIB) > 0
    assert f"kept within {KEEP_SHARE * 400:,.0f} MiB" in choice.why
    assert choose_memory_mode(100 * MIB, 400 * MIB, 2000 * MIB, 16000 * MIB).keep_bytes == 0
    # the buffer does not fit: the kept rows fit what the device leaves above the streamed peak (1900 MiB)
    tight = choose_memory_mode(100 * MIB, 400 * MIB, 2000 * MIB, 2200 * MIB)
    assert tight.mode == "stream" and tight.keep_bytes == int(FIT_SHARE * 2200 * MIB) - 1900 * MIB
    assert choose_memory_mode(100 * MIB, 400 * MIB, 2200 * MIB, 2200 * MIB).keep_bytes == 0
    none = choose_memory_mode(500 * MIB, 400 * MIB, 2000 * MIB, 80000 * MIB, keep_share=0.0)
    assert none.mode == "stream" and none.keep_bytes == 0 and "kept" not in none.why
    from fastpals import MultiTaskBert
    from fastpals.encoder.bert import BertConfig
    from fastpals.model.multitask import MultiTaskConfig, TaskSpec

    cfg = BertConfig(vocab_size=5000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    model = MultiTaskBert(MultiTaskConfig(cfg, [TaskSpec(f"t{i}", "binary") for i in range(16)]))
    shared = sum(p.numel() for n, p in model.named_parameters() if n.startswith("bert."))
    picks = [run_memory_mode(model, 16, shared, 4, 8 * 32, 32, "fp32", 0, world, "cpu") for world in (1, 2)]
    assert [c.mode for c in picks] == ["stream", "stream"]
    assert picks[0].keep_bytes == keep_bytes(estimate_activation_bytes(cfg, 8 * 32, 32)) > 0
    assert picks[1].keep_bytes == 0


def test_activation_estimate_within_15_percent_of_the_trace():
    """The analytic activations (the trainer's, no trace) against the planner's traced saved activations."""
    from fastpals.commands.memory import StepSpec, load_bert_config, trace_step

    bert = load_bert_config("minilm-l6")
    trace = trace_step(StepSpec(model="minilm-l6", max_length=128, precision="fp32"), 16)
    assert trace.peak_phase == "activations"
    estimate = estimate_activation_bytes(bert, 16 * 128, 128, "fp32")
    assert abs(estimate / trace.at_peak["activations"] - 1) < 0.15, (estimate, trace.at_peak)


def test_planner_pick_per_device():
    """BERT-base, 4 tasks, 32 x 128 tokens, fp16 with fp32 rows (1.6 GiB, below the 2.6 GiB of activations): a
    6 GiB buffer-mode peak fits an A100 but not a 4 GiB card; bf16 rows asked for: always the buffer."""
    from fastpals.commands.memory import load_bert_config

    bert = load_bert_config("bert-base-uncased")
    args = (bert, 4, 110_000_000, 32 * 128, 128, "fp16", "fp32", "auto")
    picks = plan_auto_modes(*args, 6 * 2**30, {"small": 4 * 2**30, "a100-40": int(38.5 * 2**30)})
    assert picks["small"]["mode"] == "stream" and "device" in picks["small"]["why"]
    assert picks["a100-40"]["mode"] == "buffer"
    picks = plan_auto_modes(*args[:-1], "bf16", 6 * 2**30, {"small": 4 * 2**30})
    assert picks["small"] == {"mode": "buffer", "why": "bf16 rows asked for"}


def test_memory_cli_names_auto_per_gpu(capsys):
    """The fast variant of the BERT-base run below: MiniLM, 4 tasks, 4 x 16 tokens, fp32 rows (bf16 training:
    auto's rows would be bf16; fp32 asked for here). The rows (4 x 22.7 M x 4 B) dwarf the activations of 64
    tokens: streaming on every device, and the line says why."""
    from fastpals.commands.memory import DEVICES
    from fastpals.commands.memory_cli import main

    argv = [
        "--tasks",
        "4",
        "--batch-size",
        "4",
        "--max-length",
        "16",
        "--surgery",
        "pcgrad",
        "--precision",
        "fp32",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  ") and "auto:" in line]
    assert len(lines) == len(DEVICES), out
    assert all("auto: stream (the [T, P] rows" in line for line in lines), out


@pytest.mark.slow  # three fake traces of BERT-base (about 60 s on the loaded 2-core CPU); the rule is tested above
def test_memory_cli_bert_base_8_tasks_names_auto_per_gpu(capsys):
    from fastpals.commands.memory import DEVICES
    from fastpals.commands.memory_cli import main

    assert main(["--model", "bert-base-uncased", "--tasks", "8", "--surgery", "pcgrad"]) == 0
    out = capsys.readouterr().out
    assert "surgery memory modes" in out and "buffer" in out and "stream" in out
    lines = [line for line in out.splitlines() if line.startswith("  ") and "auto:" in line]
    assert len(lines) == len(DEVICES), out
    # bf16 rows (1.6 GiB) below the activations (2.6 GiB): the buffer fits every GPU with room and is picked
    assert all("auto: buffer" in line for line in lines), out


TRAINER_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[3])
from fastpals.train.command import parse_args
from fastpals.train.loop import Trainer
model, data, out = sys.argv[1], sys.argv[2], sys.argv[4]
for batch, length, method in ((4, 16, "pcgrad"), (32, 64, "pcgrad"), (4, 16, "excessmtl")):
    tr = Trainer(parse_args(["--model", model, "--data-dir", data, "--out", f"{out}-{batch}-{method}",
        "--ds_config", "configs/cpu_fp32.json", "--surgery", method, "--surgery-memory", "auto",
        "--batch-size", str(batch),
        "--max-length", str(length), "--pal-hidden", "16", "--pal-heads", "2", "--steps-per-epoch", "1",
        "--epochs", "1", "--max-eval", "4", "--no-progress"]), callbacks=[])
    tr._setup_data(); tr._setup_model(); tr._setup_engine()
    print("MODE", batch, method, tr.surgery_memory, type(tr.surgery_buffer).__name__,
          getattr(tr.surgery_buffer, "keep_bytes", "-"))
"""


def test_trainer_resolves_auto(tmp_path):
    """The trainer's ``auto`` (tiny model, 3 tasks, fp32): 4 x 16 tokens, the rows (mostly the word embeddings)
    dwarf the activations: streaming; 32 x 64 tokens: the buffer; ExcessMTL reads the rows: the buffer. The set-up
    line says why."""
    from train_fixtures import make_tiny_data, make_tiny_model

    data, model = make_tiny_data(tmp_path / "data"), make_tiny_model(tmp_path / "model")
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    proc = subprocess.run(
        [sys.executable, "-c", TRAINER_SCRIPT, str(model), str(data), str(ROOT), str(tmp_path / "run")],
        capture_output=True, text=True, env={**env, "FASTPALS_DATA_DIR": str(data)}, timeout=300, cwd=ROOT,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    tiny = SimpleNamespace(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4
    )  # train_fixtures' model
    kept = keep_bytes(estimate_activation_bytes(tiny, 4 * 16, 16))
    assert f"MODE 4 pcgrad smaller StreamingTaskGradients {kept}" in out, out[-3000:]
    assert "MODE 32 pcgrad buffer TaskGradientBuffer" in out, out[-3000:]
    assert "MODE 4 excessmtl buffer TaskGradientBuffer" in out, out[-3000:]
    assert "auto: the [T, P] rows" in out and "auto: the buffer's peak" in out, out[-3000:]
