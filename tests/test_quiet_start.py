"""What a user sees when a run starts: at most 15 lines before the training bar (what is loaded and trained, the
device and precision), no DeepSpeed memory reports or accelerator guess, a file's skipped rows reported once;
``--verbose`` brings DeepSpeed's logging back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_fixtures import make_tiny_data, make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

MAX_LINES_BEFORE_STEP_1 = 15
DEEPSPEED_NOISE = ("before initializing group", "CPU Virtual Memory", "Setting accelerator to CPU", "[INFO]")
# bf16 with fp32 gradient accumulation: DeepSpeed's BF16_Optimizer, which prints memory reports as it sets up
DS_CONFIG = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1},
             "data_types": {"grad_accum_dtype": "fp32"}, "gradient_clipping": 1.0}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("quiet")
    (root / "ds.json").write_text(json.dumps(DS_CONFIG))
    return make_tiny_data(root / "data"), make_tiny_model(root / "model"), root / "ds.json"


def start(tiny, out, *extra):
    """A 3-update run with progress bars (as a user runs it); stdout and stderr in the order written."""
    data, model, ds_config = tiny
    cmd = [
        sys.executable, "train.py", "--ds_config", str(ds_config), "--model", str(model),
        "--data-dir", str(data), "--out", str(out), "--batch-size", "8", "--max-length", "24",
        "--pal-hidden", "16", "--pal-heads", "2", "--max-eval", "16", "--max-predict", "8", "--epochs", "1",
        "--steps-per-epoch", "3", *extra,
    ]  # fmt: skip
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "DS_ACCELERATOR", "TRANSFORMERS_VERBOSITY")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONUNBUFFERED"] = "1"  # DeepSpeed prints to stdout, the log goes to stderr: keep their order
    proc = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def lines_before_training(output: str) -> list[str]:
    lines = output.split("\n")
    first_bar = next((i for i, line in enumerate(lines) if line.startswith("train")), None)
    assert first_bar is not None, f"no training progress bar in:\n{output[-3000:]}"
    return lines[:first_bar]


def test_a_run_starts_with_few_lines_that_say_what_it_trains(tiny, tmp_path):
    output = start(tiny, tmp_path / "run")
    before = lines_before_training(output)
    assert len(before) <= MAX_LINES_BEFORE_STEP_1, "\n".join(before)
    head = "\n".join(before)
    for what in ("[data] train examples: sst", "updates/epoch", "[model] ", "tasks sst,para,sts", "parameters",
                 "[setup] precision: bf16", "device cpu", "s after the process started"):  # fmt: skip
        assert what in head, f"{what!r} missing from the start:\n{head}"
    for noise in DEEPSPEED_NOISE:
        assert noise not in output, f"{noise!r} printed without --verbose"
    assert output.count("skipped 1 bad row(s)") == 1, "the Quora file's skipped row is reported once"
    assert "[eval] step 3 epoch 1: sst" in output  # one line per evaluation


def test_verbose_shows_deepspeed_logging(tiny, tmp_path):
    output = start(tiny, tmp_path / "run", "--verbose")
    assert "before initializing group" in output and "CPU Virtual Memory" in output
    assert "[INFO]" in output  # DeepSpeed's own log at INFO level
