"""The seed systems' recipes (fastpals/configs/recipes/): each parses into TrainArgs with the options its system
names, each trains for two updates on a tiny random BERT, ``--recipe`` precedence and errors, and
``fastpals compare`` writing its table and chart."""

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_fixtures import make_tiny_data, make_tiny_model  # noqa: E402

from fastpals.train.args import TrainArgs, load_recipe, recipe_info, recipe_names  # noqa: E402
from fastpals.train.command import main as train_main  # noqa: E402
from fastpals.train.command import parse_args  # noqa: E402
from fastpals.train.errors import ConfigError  # noqa: E402

SEED_RECIPES = {
    "000_sbert_pcgrad", "001_pal_pcgrad_cosine", "002_pal12_gem", "003_embert", "003_pal_top",
    "003_pal_top_parallel", "003_pal_gate", "004_pal_zero", "004_pal_half", "004_pal_full",
    "baseline_multitask", "single_sst", "single_para", "single_sts",
}  # fmt: skip


def make_tiny_model_6_layers(folder: Path) -> Path:
    """A random 6-layer BERT (d = 32, 4 heads) with MiniLM's vocab: deep enough for the 'half' PAL preset (top 6
    layers)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from fastpals.data.hub import resolve_model_dir
    from fastpals.encoder.bert import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    vocab = resolve_model_dir("minilm-l6", ("vocab.txt",)) / "vocab.txt"
    shutil.copy(vocab, folder / "vocab.txt")
    config = {"vocab_size": sum(1 for _ in open(vocab, encoding="utf-8")), "hidden_size": 32,
              "num_hidden_layers": 6, "num_attention_heads": 4, "intermediate_size": 64,
              "max_position_embeddings": 64, "type_vocab_size": 2, "hidden_dropout_prob": 0.1,
              "attention_probs_dropout_prob": 0.1, "layer_norm_eps": 1e-12, "model_type": "bert"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = BertModel(BertConfig.from_dict(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module", autouse=True)
def own_process_group():
    """The in-process runs here set RANK/WORLD_SIZE/MASTER_PORT... and start a one-process group listening on
    MASTER_PORT: afterwards, close it and restore the environment, so that later tests' subprocesses do not
    inherit a port in use."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    return make_tiny_data(root / "data", n=16), make_tiny_model(root / "model")


@pytest.fixture(scope="module")
def tiny6(tiny, tmp_path_factory):
    return tiny[0], make_tiny_model_6_layers(tmp_path_factory.mktemp("recipes6") / "model")


def quick(tiny, out, *extra, steps=2):
    data, model = tiny
    return ["--model", str(model), "--data-dir", str(data), "--out", str(out), "--batch-size", "4",
            "--max-length", "16", "--max-eval", "6", "--max-predict", "1", "--epochs", "1",
            "--steps-per-epoch", str(steps), "--no-progress", *extra]  # fmt: skip


def test_the_seed_systems_have_recipes():
    assert set(recipe_names()) == SEED_RECIPES
    for name in recipe_names():
        info = recipe_info(name)
        assert info["description"] and info["source"], name
        assert load_recipe(name)["batching"] == "per_task", name  # the seeds drew one task per batch


def test_every_recipe_parses_into_its_system(tiny6, tmp_path):
    args = {name: parse_args(["--recipe", name, *quick(tiny6, tmp_path / name)]) for name in recipe_names()}
    assert all(isinstance(a, TrainArgs) and a.batching == "per_task" for a in args.values())
    a = args["000_sbert_pcgrad"]
    assert (a.pal_config.num_heads, a.surgery, a.sampling, a.optimizer, a.pair_mode) == (
        12, "pcgrad", "annealed", "adamw", "sbert_cosine")  # fmt: skip
    a = args["001_pal_pcgrad_cosine"]
    assert (a.pal_config.num_heads, a.pal_config.hidden, a.surgery, a.pair_mode) == (
        6,
        204,
        "pcgrad",
        "sbert_cosine",
    )
    assert "sts" in a.task_list
    a = args["002_pal12_gem"]
    assert (a.pal_config.num_heads, a.surgery, a.sampling, a.head) == (12, "gem", "random_round_robin", "mlp")
    assert args["003_embert"].pal_config.variant == "embert"
    assert args["003_pal_top"].pal_config.variant == "top"
    assert args["003_pal_top_parallel"].pal_config.variant == "top_parallel"
    assert args["003_pal_gate"].pal_config.gate
    for name in ("003_embert", "003_pal_top", "003_pal_top_parallel", "003_pal_gate"):
        assert args[name].task_list == ["sst", "para", "sts", "cfimdb"], name
    assert args["004_pal_zero"].pal_config is None
    assert args["004_pal_half"].pal_config.layers == 6 and args["004_pal_half"].pal_config.hidden == 276
    assert args["004_pal_full"].pal_config.layers == "all"
    assert args["baseline_multitask"].pal_config is None and args["baseline_multitask"].surgery == "none"
    for task in ("sst", "para", "sts"):
        assert args[f"single_{task}"].task_list == [task] and args[f"single_{task}"].pal_config is None


def test_every_recipe_trains(tiny, tiny6, tmp_path):
    """Each recipe runs one update and scores its dev tasks, on a 2-layer random BERT (6 layers for the 'half'
    preset, which puts PALs in the top 6) with the PAL width cut to 24 (a multiple of every preset's heads)."""
    from fastpals.train.loop import Trainer

    for name in recipe_names():
        recipe = load_recipe(name)
        narrow = ["--pal-hidden", "24"] if recipe["pal"] != "none" else []
        model = tiny6 if recipe["pal"] == "half" else tiny
        args = parse_args(["--recipe", name, *quick(model, tmp_path / name, *narrow, steps=1)])
        results = Trainer(args).run()
        assert results["steps"] == 1, name
        assert set(results["dev"]) == {*args.task_list, "overall"}, name
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses = [v for r in records if r["type"] == "step" for v in r["loss"].values()]
        assert losses and all(v == v and abs(v) < 1e4 for v in losses), (name, losses)
        saved = json.loads((tmp_path / name / "train_args.json").read_text())
        assert {k: saved[k] for k in recipe} == recipe, name  # the run used the recipe's options


def test_command_line_overrides_the_recipe(tiny, tmp_path):
    recipe = load_recipe("002_pal12_gem")
    a = parse_args(["--recipe", "002_pal12_gem", *quick(tiny, tmp_path), "--head", "linear", "--surgery", "gem",
                    "--surgery-opt", "tol=1e-9"])  # fmt: skip
    assert (a.head, a.surgery, a.surgery_opts) == ("linear", "gem", ["tol=1e-9"])
    assert (a.sampling, a.pal) == (recipe["sampling"], recipe["pal"])  # not given: the recipe's
    assert a.lr == TrainArgs.__dataclass_fields__["lr"].default  # in neither: TrainArgs' default
    # a recipe file by path, and `--tasks` choosing a pairwise subset of a 004 recipe
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"description": "x", "pal": "half", "tasks": "sst,sts", "warmup": 0.2}))
    a = parse_args(["--recipe", str(path), *quick(tiny, tmp_path)])
    assert (a.pal, a.task_list, a.warmup) == ("half", ["sst", "sts"], 0.2)
    a = parse_args(["--recipe", "004_pal_half", *quick(tiny, tmp_path), "--tasks", "sst,para"])
    assert a.task_list == ["sst", "para"] and a.pal == "half"


@pytest.mark.parametrize(
    "content, message",
    [
        ({"pal": "none", "pals": "12heads"}, "key 'pals' is not a training option"),
        ({"lr": "fast"}, "key 'lr' has a value of the wrong type"),
        ({"eval_at_start": 1}, "key 'eval_at_start' has a value of the wrong type"),
        ({"resume": True}, "key 'resume' belongs to one command"),
        (["pal", "none"], "a recipe is a JSON object"),
        ('{\n  "pal": "none",\n}', ":3: not valid JSON"),
    ],
)
def test_bad_recipe_file_is_one_line_naming_file_and_key(tiny, tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError, match=message) as err:
        parse_args(["--recipe", str(path), *quick(tiny, tmp_path)])
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_help_lists_the_recipes():
    from fastpals.train.command import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--recipe NAME start from a named recipe's options" in text
    assert all(name in text.replace("- ", "-") for name in recipe_names())


def test_recipe_errors_from_the_command_line(tiny, tmp_path, capsys):
    assert train_main(["--recipe", "nope", *quick(tiny, tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'nope'" in err and all(n in err for n in recipe_names())
    assert train_main(["--recipe", "004_pal_zero", *quick(tiny, tmp_path), "--resume"]) == 2
    assert "--recipe starts a new run" in capsys.readouterr().err
    path = tmp_path / "bad_value.json"
    path.write_text(json.dumps({"pal": "thirteen_heads"}))
    assert train_main(["--recipe", str(path), *quick(tiny, tmp_path)]) == 2  # values are TrainArgs' to check
    assert "--pal 'thirteen_heads': choose one of" in capsys.readouterr().err


def test_compare_two_recipes_writes_table_and_chart(tiny, tmp_path, capsys):
    from fastpals.cli import main as fastpals_main

    data, model = tiny
    out = tmp_path / "cmp"
    common = ["--model", str(model), "--data-dir", str(data), "--batch-size", "4", "--max-length", "16",
              "--no-progress"]  # fmt: skip
    rc = fastpals_main(["compare", "baseline_multitask", "single_sst", "--budget", "2", "--out", str(out),
                        "--max-eval", "6", *common])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    assert "[compare] 1/2 baseline_multitask: start" in err and "[compare] 2/2 single_sst: done in" in err
    table = (out / "compare.md").read_text().splitlines()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table
            if line.startswith("| ") and not line.startswith("| recipe")}  # fmt: skip
    assert list(rows) == ["untrained (baseline_multitask, step 0)", "baseline_multitask", "single_sst",
                          "single-task (single_sst)"]  # fmt: skip
    header = [c.strip() for c in next(line for line in table if line.startswith("| recipe")).split("|")[2:-1]]
    assert header == [
        "SST acc",
        "Quora acc*",
        "STS r",
        "overall†",
        "updates",
        "examples",
        "train s",
        "total s",
    ]
    base, single = rows["baseline_multitask"], rows["single_sst"]
    assert base[4] == "2" and int(base[5]) == 8 and single[4] == "2" and int(single[5]) == 8  # 2 x batch 4
    assert single[1] == single[2] == single[3] == "—"  # single_sst has no Quora, STS or overall
    saved = json.loads((out / "compare.json").read_text())
    for row in saved["rows"][1:3]:
        sst = row["scores"]["sst"]
        assert rows[row["name"]][0] == f"{sst:.3f}" and 0.0 <= sst <= 1.0
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "baseline_multitask" / "results.json").is_file()
    # the second run is the run it would be alone: order in the comparison changes nothing (same seed and data)
    from fastpals.train.loop import Trainer

    alone = Trainer(parse_args(["--recipe", "single_sst", *common, "--epochs", "1", "--steps-per-epoch", "2",
                                "--out", str(tmp_path / "alone"), "--max-predict", "8", "--max-eval", "6"])).run()  # fmt: skip
    assert alone["dev"] == json.loads((out / "single_sst" / "results.json").read_text())["dev"]

    def losses(run):
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in records if r["type"] == "step"]

    assert len(losses(out / "single_sst")) == 2 and losses(tmp_path / "alone") == losses(out / "single_sst")


def test_compare_rejects_bad_input_before_training(tiny, tmp_path, capsys):
    from fastpals.commands.compare import main as compare_main

    data, model = tiny
    out = tmp_path / "cmp"
    common = ["--budget", "2", "--out", str(out), "--model", str(model), "--data-dir", str(data)]
    assert compare_main(["baseline_multitask", "nope", *common]) == 2
    assert "no such recipe" in capsys.readouterr().err
    assert compare_main(["baseline_multitask", *common, "--epochs", "3"]) == 2
    assert "--epochs is set by compare itself" in capsys.readouterr().err
    assert compare_main([*common]) == 2
    assert compare_main(["--help"]) == 0 and "--budget STEPS" in capsys.readouterr().out
    assert compare_main(["single_sst", "single_sst", *common]) == 2
    assert not out.exists()  # nothing ran


def test_compare_reports_a_failed_run_in_its_row(tiny, tmp_path, capsys):
    from fastpals.commands.compare import main as compare_main

    data, model = tiny
    out = tmp_path / "cmp"
    rc = compare_main(["single_sst", "--budget", "2", "--out", str(out), "--model", str(model), "--data-dir",
                       str(data), "--batch-size", "4", "--max-length", "16", "--max-eval", "6", "--no-progress",
                       "--inject-nan-at-step", "2"])  # fmt: skip
    assert rc == 1
    assert "[compare] 1/1 single_sst: done in" in capsys.readouterr().err
    (row,) = [
        line for line in (out / "compare.md").read_text().splitlines() if line.startswith("| single_sst")
    ]
    cells = row.split("|")[1:-1]
    assert "failed: non-finite loss" in cells[1] and "update step 2" in cells[1]
    assert len(cells) == 9  # recipe, SST, Quora, STS r, overall, updates, examples, train s, total s


def test_freeze_layers_stops_the_backward_and_guards_the_pals(tiny6, tmp_path):
    """``--freeze-layers K --pal-layers N``: embeddings and layers 0..K-1 get no gradient and no backward (their
    outputs need no grad), PALs sit in the top N layers only; PALs left in a frozen layer are a ConfigError."""
    from fastpals.data.mixed_batches import model_inputs, pack_batches
    from fastpals.train.data_setup import setup_data
    from fastpals.train.optimizer_setup import build_model

    args = parse_args([*quick(tiny6, tmp_path / "f"), "--freeze-layers", "2", "--pal-layers", "4"])
    model = build_model(args).train()
    layers = model.bert.encoder.layer
    assert [i for i, layer in enumerate(layers) if getattr(layer, "pal", None) is not None] == [2, 3, 4, 5]
    for name, p in model.named_parameters():
        frozen = name.startswith(("bert.embeddings.", "bert.encoder.layer.0.", "bert.encoder.layer.1."))
        assert p.requires_grad != frozen, name
    needs_grad = {}
    for i in (1, 2):
        layers[i].register_forward_hook(lambda m, a, out, i=i: needs_grad.__setitem__(i, out.requires_grad))
    data = setup_data(args, 0, 1, lambda message: None)
    batches = [next(iter(data.train_batchers[t])) for t in args.task_list]
    packed = pack_batches(batches, list(range(len(batches))), len(batches))
    res = model.task_losses(model(**model_inputs(packed, "cpu")), packed["labels"], "equal")
    sum(res.per_task.values()).backward()
    assert needs_grad == {1: False, 2: True}
    assert layers[2].output.dense.weight.grad is not None and layers[1].output.dense.weight.grad is None
    with pytest.raises(
        ConfigError, match=r"--freeze-layers 2 would freeze the task-specific bert\.encoder\.layer\.0"
    ):
        build_model(parse_args([*quick(tiny6, tmp_path / "g"), "--freeze-layers", "2"]))
    with pytest.raises(ConfigError, match="--freeze-layers 7: the encoder has 6 layers"):
        build_model(parse_args([*quick(tiny6, tmp_path / "h"), "--freeze-layers", "7", "--pal", "none"]))
    with pytest.raises(ConfigError, match="--pal-layers need PALs"):
        parse_args([*quick(tiny6, tmp_path / "i"), "--pal", "none", "--pal-layers", "2"])
