"""Trainer checks that need no training: options, DeepSpeed config contradictions, optimizer groups, schedule,
and (in a subprocess, so that no process group leaks into the test session) one PCGrad update under DeepSpeed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastpals.encoder.bert import BertConfig, PALConfig
from fastpals.model.multitask import MultiTaskBert, MultiTaskConfig, get_task
from fastpals.train.command import parse_args
from fastpals.train.dsconfig import check_ds_config, cpu_has_native_bf16, load_ds_config, precision_note
from fastpals.train.errors import ConfigError
from fastpals.train.optimizer_setup import lr_lambda, optimizer_param_groups

ROOT = Path(__file__).resolve().parent.parent


def parse(tiny, *extra):
    """Options from a command line, checked (``TrainArgs.__post_init__``)."""
    data, model = tiny
    return parse_args(["--model", str(model), "--data-dir", str(data), *extra])


def test_valid_options_pass(tiny):
    args = parse(tiny, "--tasks", "sst,sts", "--pal", "12heads")
    assert args.task_list == ["sst", "sts"]
    assert args.pal_config.num_heads == 12 and args.pal_config.hidden == 204
    assert args.batch_size == 32 and args.grad_accum == 1  # not in the shipped config: option defaults
    assert parse(tiny, "--pal", "none").pal_config is None


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tasks", "sst,imdb"], "unknown task"),
        (["--tasks", "sst,sst"], "twice"),
        (["--pal-heads", "5"], "does not divide the PAL width d_s = 204"),
        (["--pal-hidden", "100", "--pal-heads", "3"], "does not divide"),
        (["--pal", "none", "--pal-heads", "2"], "need PALs"),
        (["--surgery", "pcgrad", "--grad-accum", "2"], "--grad-accum 1"),
        (["--surgery", "gem", "--tasks", "sst"], "at least two"),
        (
            ["--batching", "per_task", "--sampling", "random_round_robin", "--grad-accum", "2"],
            "--grad-accum 1",
        ),
        (["--batching", "per_task", "--max-tokens", "512"], "--max-tokens needs --batching mixed"),
        (["--batching", "per_task", "--task-weighting", "equal"], "--batching mixed"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--surgery-opt", "c=0.5"], "need a --surgery method"),
        (["--surgery-memory", "stream"], "--surgery-memory stream needs a --surgery method"),
        (["--surgery", "pcgrad", "--batching", "per_task", "--surgery-memory", "stream"], "--batching mixed"),
        (["--surgery", "pcgrad", "--surgery-memory", "stream", "--surgery-buffer-dtype", "bf16"], "has none"),
        (
            ["--surgery", "excessmtl", "--surgery-memory", "stream"],
            "does not keep: use --surgery-memory buffer",
        ),
        (["--surgery", "cagrad", "--surgery-opt", "cc=0.5"], "unknown option 'cc'"),
        (["--surgery", "cagrad", "--surgery-opt", "c"], "KEY=VALUE"),
        (["--surgery", "fairgrad", "--surgery-opt", "alpha=abc"], "alpha"),
        (["--lr", "-1"], "--lr must be a positive"),
        (["--warmup", "1.5"], "--warmup"),
        (["--max-length", "4"], "--max-length"),
        (["--epochs", "0"], "--epochs"),
        (["--batch-size", "0"], "--batch-size"),
        (["--freeze-bert", "--pal", "none"], "--freeze-bert"),
        (["--pair-mode", "sbert_cosine", "--tasks", "sst,para"], "sbert_cosine"),
    ],
)
def test_bad_options(tiny, extra, message):
    with pytest.raises(ConfigError, match=message.replace("-", r"\-").replace("(", r"\(")):
        parse(tiny, *extra)


def test_missing_data(tiny, tmp_path):
    _, model = tiny
    with pytest.raises(ConfigError, match="missing data file.*ids-sst-train.csv"):
        parse_args(["--model", str(model), "--data-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="--data-dir"):
        parse_args(["--model", str(model), "--data-dir", str(tmp_path / "nope")])


def test_ds_config_contradictions():
    base = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}
    filled = check_ds_config(base, 16, 2, cuda=False)
    assert filled["train_micro_batch_size_per_gpu"] == 16
    assert filled["gradient_accumulation_steps"] == 2 and filled["train_batch_size"] == 32
    assert check_ds_config(base, 16, 1, surgery="pcgrad", cuda=False)["gradient_accumulation_steps"] == 1
    cases = [
        (
            {**base, "train_micro_batch_size_per_gpu": 8},
            {},
            "train_micro_batch_size_per_gpu = 8 but --batch-size 16",
        ),
        ({**base, "gradient_accumulation_steps": 4}, {}, "gradient_accumulation_steps = 4"),
        ({**base, "train_batch_size": 100}, {}, "train_batch_size = 100"),
        ({**base, "optimizer": {"type": "Adam"}}, {}, "remove the 'optimizer' section"),
        ({**base, "scheduler": {"type": "WarmupLR"}}, {}, "remove the 'scheduler' section"),
        ({"fp16": {"enabled": True}}, {}, "fp16 needs a CUDA GPU"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, {"cuda": True}, "both enabled"),
        ({**base, "zero_optimization": {"stage": 3}}, {}, "ZeRO-3"),
        ({"bf16": {"enabled": True}}, {}, "stage 0 on CPU"),
        ({**base, "gradient_clipping": -1}, {}, "gradient_clipping"),
    ]
    for cfg, kw, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            check_ds_config(cfg, 16, 1, **{"cuda": False, **kw})
    with pytest.raises(ConfigError, match="surgery"):
        check_ds_config({**base, "gradient_accumulation_steps": 2}, 16, 1, surgery="pcgrad", cuda=False)


def test_shipped_configs_parse_and_validate():
    names = sorted(p.name for p in (ROOT / "fastpals" / "configs").glob("*.json"))
    expected = ["cpu_auto.json", "cpu_bf16.json", "cpu_fp32.json"] + [
        f"gpu_{p}_zero{z}.json" for p in ("bf16", "fp16") for z in (0, 1, 2)
    ]
    assert sorted(expected) == names
    for name in names:
        cfg = load_ds_config(ROOT / "configs" / name)
        checked = check_ds_config(cfg, 32, 1, cuda=name.startswith("gpu"))
        assert checked["gradient_clipping"] == 1.0
        stage = cfg.get("zero_optimization", {}).get("stage")
        if name.startswith("gpu"):
            precision, zero = name[4:8], int(name[-6])
            assert cfg[precision]["enabled"] and stage == zero
            if precision == "fp16":
                assert cfg["fp16"]["loss_scale"] == 0  # dynamic loss scaling
        elif name == "cpu_bf16.json":
            assert cfg["bf16"]["enabled"] is True and stage == 1
        elif name == "cpu_auto.json":
            assert cfg["bf16"]["enabled"] == "auto" and stage == "auto"
            for native in (True, False):
                resolved = check_ds_config(cfg, 32, 1, cuda=False, native_bf16=native)
                assert resolved["bf16"]["enabled"] is native
                assert resolved["zero_optimization"]["stage"] == (1 if native else 0)
            two_ranks = check_ds_config(cfg, 32, 1, world_size=2, cuda=False, native_bf16=False)
            assert two_ranks["zero_optimization"]["stage"] == 1
        else:
            assert "bf16" not in cfg and "fp16" not in cfg
    with pytest.raises(ConfigError, match="missing.json does not exist"):
        load_ds_config(ROOT / "configs" / "missing.json")
    from deepspeed.runtime.config import DeepSpeedConfig

    class OneRank:  # stands in for a process group: DeepSpeed's parser asks for the world size
        def get_data_parallel_world_size(self):
            return 1

        def get_model_parallel_world_size(self):
            return 1

        def get_data_parallel_rank(self):
            return 0

        def get_model_parallel_rank(self):
            return 0

    for name in names:  # DeepSpeed's own parser accepts them too
        cfg = check_ds_config(load_ds_config(ROOT / "configs" / name), 32, 1, cuda=True)
        parsed = DeepSpeedConfig(cfg, mpu=OneRank())
        assert parsed.gradient_clipping == 1.0 and parsed.train_batch_size == 32
        assert parsed.zero_optimization_stage == cfg["zero_optimization"]["stage"]


def test_bf16_auto_resolves_by_hardware_and_says_why():

    auto = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 1}}
    native = check_ds_config(auto, 8, 1, cuda=False, native_bf16=True)
    emulated = check_ds_config(auto, 8, 1, cuda=False, native_bf16=False)
    assert native["bf16"]["enabled"] is True and emulated["bf16"]["enabled"] is False
    assert auto["bf16"]["enabled"] == "auto", "the caller's config is not modified"
    assert "native on this CPU" in precision_note(auto, native, cuda=False, native_bf16=True)
    note = precision_note(auto, emulated, cuda=False, native_bf16=False)
    assert note.startswith("precision: fp32") and "no native bf16" in note
    explicit = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
    checked = check_ds_config(explicit, 8, 1, cuda=False, native_bf16=False)
    assert checked["bf16"]["enabled"] is True  # asked for explicitly: kept, with a warning in the log line
    assert "emulated" in precision_note(explicit, checked, cuda=False, native_bf16=False)
    assert (
        precision_note(explicit, checked, cuda=False, native_bf16=True)
        == "precision: bf16 (--ds_config), ZeRO stage 1"
    )
    for bad, message in (
        ({"bf16": {"enabled": "yes"}}, "bf16.enabled = 'yes'"),
        ({"fp16": {"enabled": "auto"}}, "fp16.enabled"),
    ):
        with pytest.raises(ConfigError, match=message):
            check_ds_config(bad, 8, 1, cuda=False)
    # the detector agrees with the CPU's own flags where Linux lists them
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags = cpuinfo.read_text().split()
        assert cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_grad_accum_dtype_auto_picks_fp32_accumulation_without_surgery():
    auto = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": "auto"},
            "data_types": {"grad_accum_dtype": "auto"}}  # fmt: skip
    native = check_ds_config(auto, 8, 1, cuda=False, native_bf16=True)
    assert (
        native["data_types"] == {"grad_accum_dtype": "fp32"}
        and native["bf16"]["immediate_grad_update"] is True
    )
    assert "fp32 gradient accumulation" in precision_note(auto, native, cuda=False, native_bf16=True)
    assert auto["data_types"]["grad_accum_dtype"] == "auto", "the caller's config is not modified"
    emulated = check_ds_config(
        auto, 8, 1, cuda=False, native_bf16=False
    )  # fp32 training: DeepSpeed's default
    assert "data_types" not in emulated and "immediate_grad_update" not in emulated["bf16"]
    surgery = check_ds_config(auto, 8, 1, surgery="pcgrad", cuda=False, native_bf16=True)
    assert "data_types" not in surgery and surgery["zero_optimization"]["stage"] == 1
    kept = {**auto, "data_types": {"grad_accum_dtype": "auto", "param_dtype": "bf16"}}  # other entries stay
    assert check_ds_config(kept, 8, 1, surgery="gem", cuda=False, native_bf16=True)["data_types"] == {
        "param_dtype": "bf16"
    }
    explicit = {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "data_types": {"grad_accum_dtype": "fp32"},
    }
    assert check_ds_config(explicit, 8, 1, cuda=False)["data_types"] == {"grad_accum_dtype": "fp32"}
    with pytest.raises(ConfigError, match="grad_accum_dtype = fp32 with bf16 and ZeRO-1.*--surgery pcgrad"):
        check_ds_config(explicit, 8, 1, surgery="pcgrad", cuda=False)


FP32_ACCUMULATION_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
from fastpals.train.command import parse_args
from fastpals.train.loop import Trainer
model, data, out = sys.argv[1], sys.argv[2], sys.argv[4]
params = {}
for name, extra in (("zero", {}), ("fp32", {"data_types": {"grad_accum_dtype": "auto"}})):
    cfg = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, **extra}
    path = f"{out}-{name}.json"
    json.dump(cfg, open(path, "w"))
    tr = Trainer(parse_args(["--model", model, "--data-dir", data, "--out", f"{out}-{name}", "--ds_config", path,
        "--batch-size", "8", "--max-length", "16", "--pal-hidden", "16", "--pal-heads", "2", "--steps-per-epoch", "3",
        "--epochs", "1", "--lr", "1e-3", "--max-eval", "4", "--no-progress", "--freeze-layers", "1",
        "--pal-layers", "1"]))
    tr._setup_data(); tr._setup_model(); tr._setup_engine(); tr.engine.train()
    print(name, type(tr.engine.optimizer).__name__, "allreduce", tr.engine.enable_backward_allreduce)
    for _ in range(3):
        tr.train_update(tr.sampler.next_update())
    params[name] = {n: p.detach().float().clone() for n, p in tr.engine.module.named_parameters()}
assert params["zero"].keys() == params["fp32"].keys()
diff = max((params["zero"][n] - params["fp32"][n]).abs().max().item() for n in params["zero"])
print("max diff", diff)
"""


@pytest.mark.skipif(
    not cpu_has_native_bf16(),
    reason="bf16 training on a CPU without native bf16 is emulated (20x slower)",
)
def test_fp32_gradient_accumulation_gives_the_zero1_updates(tiny, tmp_path):
    """bf16 + ZeRO-1 with ``grad_accum_dtype`` auto runs DeepSpeed's BF16_Optimizer (fp32 gradients filled during
    the backward, no all-reduce over the one rank); with one micro-batch per update its three updates equal the
    ZeRO-1 optimizer's bit for bit."""
    data, model = tiny
    env = {**os.environ, "FASTPALS_DATA_DIR": str(data)}
    proc = subprocess.run(
        [sys.executable, "-c", FP32_ACCUMULATION_SCRIPT, str(model), str(data), str(ROOT), str(tmp_path / "run")],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    # one rank: the fp32 path skips DeepSpeed's identity all-reduce (ZeRO-1's reduce_gradients stays)
    assert (
        "zero DeepSpeedZeroOptimizer allreduce True" in out and "fp32 BF16_Optimizer allreduce False" in out
    ), out
    assert "max diff 0.0" in out, out


def test_bad_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"bf16": {"enabled": true},}')
    with pytest.raises(ConfigError, match="bad.json:1: not valid JSON"):
        load_ds_config(path)


def _tiny_model(pal):
    bert = BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    cfg = MultiTaskConfig(bert, [get_task(t) for t in ("sst", "para", "sts")], pal)
    return MultiTaskBert(cfg)


def test_optimizer_param_groups():
    model = _tiny_model(PALConfig(hidden=16, num_heads=2, gate=True))
    groups = optimizer_param_groups(model, 1e-5, 1e-4, 1e-3, 0.01)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"encoder", "encoder_no_decay", "pal", "pal_no_decay", "head", "head_no_decay"}
    names = {id(p): n for n, p in model.named_parameters()}
    for g in groups:
        kind = g["name"].split("_")[0]
        assert g["lr"] == {"encoder": 1e-5, "pal": 1e-4, "head": 1e-3}[kind]
        assert g["weight_decay"] == (0.0 if g["name"].endswith("no_decay") else 0.01)
        for p in g["params"]:
            n = names[id(p)]
            no_decay = n.endswith("bias") or "LayerNorm" in n or n.endswith(".gate")
            assert no_decay == g["name"].endswith("no_decay"), n
            if kind == "head":
                assert n.startswith("heads.")
            elif kind == "pal":
                assert ".pal" in n or "pal_" in n
    covered = [id(p) for g in groups for p in g["params"]]
    assert sorted(covered) == sorted(id(p) for p in model.parameters())  # each parameter exactly once
    assert "bert.pal_projections.enc_bias" in {names[id(p)] for p in by_name["pal_no_decay"]["params"]}
    # frozen parameters are left out
    for n, p in model.named_parameters():
        if n.startswith("bert.embeddings.word"):
            p.requires_grad_(False)
    assert sum(len(g["params"]) for g in optimizer_param_groups(model, 1, 1, 1, 0)) == len(covered) - 1


def test_lr_schedule():
    values = [lr_lambda(s, 100, 0.1) for s in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert values[10] == pytest.approx(1.0) and values[55] == pytest.approx(0.5)
    assert values[99] == pytest.approx(1 / 90) and lr_lambda(100, 100, 0.1) == 0.0
    assert all(a >= b for a, b in zip(values[10:], values[11:]))
    assert lr_lambda(0, 10, 0.0) == 1.0


SURGERY_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[3])
from fastpals.train.command import parse_args
from fastpals.train.loop import Trainer
args = parse_args(["--model", sys.argv[1], "--data-dir", sys.argv[2], "--out", sys.argv[4],
    "--ds_config", "cpu_bf16.json", "--surgery", "pcgrad", "--sampling", "random_round_robin", "--batch-size", "4", "--max-length", "16",
    "--pal-hidden", "16", "--pal-heads", "2", "--steps-per-epoch", "2", "--epochs", "1", "--lr", "1e-2",
    "--max-eval", "4", "--no-progress", "--batching", sys.argv[5]])
tr = Trainer(args)
tr._setup_data(); tr._setup_model(); tr._setup_engine()
assert tr.zero_stage == 1
module = tr.engine.module
shared = {n: p.detach().float().clone() for n, p in module.named_parameters() if n.startswith("bert.encoder.layer.0.attention.self.query")}
buf = tr.surgery_buffer
results = []
apply = buf.apply
buf.apply = lambda *a, **k: results.append(apply(*a, **k)) or results[-1]
stats = tr.train_update([2, 0, 1] if sys.argv[5] == "per_task" else tr.sampler.next_update())
assert buf.steps == 1 and buf.skipped_steps == 0 and len(results) == 1
norms = results[0].gram.diagonal().tolist()
print("squared row norms", norms)
assert norms[0] > 0 and norms[1] > 0  # tasks 0 and 1 captured
changed = [not torch.equal(p.detach().float(), shared[n]) for n, p in module.named_parameters() if n in shared]
assert changed and all(changed), changed
assert set(stats["loss"]) == {"sst", "para", "sts"}
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["per_task", "mixed"])
def test_pcgrad_update_under_deepspeed(tiny, tmp_path, batching):
    """ZeRO-1 bf16: T backwards into the buffer (per_task), or every task's gradient from one backward over a
    packed mixed micro-batch (mixed); both change the shared weights through the PCGrad combination."""
    data, model = tiny
    env = {**os.environ, "FASTPALS_DATA_DIR": str(data)}
    proc = subprocess.run(
        [sys.executable, "-c", SURGERY_SCRIPT, str(model), str(data), str(ROOT), str(tmp_path / "run"), batching],
        capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_capped_dev_sets_are_a_fixed_random_subset(tiny):
    from fastpals.data.loading import load_task
    from fastpals.model.evaluate import load_split as _load_split

    data, _ = tiny
    full = load_task("sst", "dev", data)
    a = _load_split("sst", "dev", data, 10, print, sample=True)
    b = _load_split("sst", "dev", data, 10, print, sample=True)
    assert [e.id for e in a] == [e.id for e in b] and len(a) == 10
    positions = [full.index(e) for e in a]
    assert positions == sorted(positions) and positions != list(range(10))  # file order kept, not the head
    assert _load_split("sst", "dev", data, 10, print) == full[:10]
    assert _load_split("sst", "dev", data, 10**6, print, sample=True) == full


def test_shipped_configs_resolve_by_name_from_any_folder(tmp_path, monkeypatch):
    from fastpals.train.dsconfig import resolve_ds_config, shipped_configs

    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    for spelling in ("cpu_bf16.json", "configs/cpu_bf16.json"):
        assert resolve_ds_config(spelling) == shipped_configs()["cpu_bf16.json"]
    assert load_ds_config("cpu_fp32.json") == load_ds_config(ROOT / "configs" / "cpu_fp32.json")
    with pytest.raises(ConfigError, match="nope.json does not exist.*cpu_bf16.json"):
        resolve_ds_config("nope.json")
    (tmp_path / "mine.json").write_text('{"bf16": {"enabled": true}}')
    assert resolve_ds_config("mine.json") == Path("mine.json")  # a file given by path wins


@pytest.mark.slow
def test_default_ds_config_works_from_a_wheel(tmp_path):
    import zipfile

    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(tmp_path / "dist"), str(ROOT)],
        check=True, capture_output=True, env={**os.environ, "FASTPALS_BUILD_CUDA": "0"},
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("fastpals-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    assert (site / "fastpals" / "configs" / "cpu_auto.json").is_file()
    code = (
        "import fastpals.train.dsconfig as d, fastpals.train.args as a; "
        "print(d.resolve_ds_config(a.TrainArgs.__dataclass_fields__['ds_config'].default))"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=elsewhere,
                          env={**os.environ, "PYTHONPATH": str(site)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()) == site / "fastpals" / "configs" / "cpu_auto.json"


def test_eval_model_keeps_the_training_dtype_where_the_cpu_runs_it(monkeypatch):
    """Dev and test predictions run in the training dtype on a CPU with native bf16 (the module itself, or a bf16
    copy of the fp32 best weights); without native bf16, or for fp16, an fp32 copy with the same weights."""
    import fastpals.encoder.precision as precision
    from fastpals.model.evaluate import eval_model

    cpu = torch.device("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).to(torch.bfloat16)
    fp32 = torch.nn.Sequential(torch.nn.Linear(4, 3))
    for native in (True, False):
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda native=native: native)
        got = eval_model(model, cpu)
        assert (got is model) == native and next(got.parameters()).dtype == (
            torch.bfloat16 if native else torch.float32
        )
        assert torch.equal(got[0].weight.float(), model[0].weight.float())
        best = eval_model(fp32, cpu, torch.bfloat16)
        assert (best is not fp32) == native and next(best.parameters()).dtype == (
            torch.bfloat16 if native else torch.float32
        )
        assert next(fp32.parameters()).dtype == torch.float32, "the caller's module is not changed"
        assert eval_model(fp32, cpu) is fp32
        half = eval_model(fp32.half(), cpu)
        assert next(half.parameters()).dtype == torch.float32
        fp32.float()
