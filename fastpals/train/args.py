"""Every option of a training run: :class:`TrainArgs`, one dataclass field per command-line option;
``__post_init__`` checks them and raises a one-line :class:`ConfigError` naming the option. Named recipes:
JSON objects of options (and ``description``, ``source``) in ``fastpals/configs/recipes/`` or a path,
``--recipe``'s defaults, which options override."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from fastpals.data.loading import DATA_DIR_ENV, resolve_data_dir, split_path
from fastpals.data.sampling import GROUPED_METHODS, SAMPLING_METHODS
from fastpals.data.tasks import TaskSpec, resolve_tasks
from fastpals.encoder.bert import PALConfig
from fastpals.encoder.pal_variants import pal_presets
from fastpals.model.multitask import TASK_WEIGHTINGS, TASKS
from fastpals.surgery import AGGREGATORS, make_weighting, parse_surgery_options
from fastpals.train.dsconfig import DEFAULT_DS_CONFIG, load_ds_config
from fastpals.train.errors import ConfigError, read_json_object
from fastpals.train.memory_mode import SURGERY_MEMORIES
from fastpals.train.optimizer_setup import OPTIMIZERS

#: ``--pal`` presets: the PALConfig fields of each (None: no PALs), from the registered PAL variants
PAL_PRESETS: dict[str, dict[str, Any] | None] = {
    name: None if preset.fields is None else dict(preset.fields) for name, preset in pal_presets().items()
}
_PAL_HELP = ", ".join(
    f"{name} ({preset.help})" if preset.help else name for name, preset in pal_presets().items()
)
SURGERIES = ("none", *AGGREGATORS)
BATCHINGS = ("per_task", "mixed")
SURGERY_BUFFER_DTYPES = ("auto", "fp32", "bf16")
MAY = "may_change"  # ``opt(resume=MAY)``: an option a resumed run may give anew
#: the lower bound of each numeric option (None stays allowed where it is the default)
_LOWER_BOUNDS = {"epochs": 1, "batch_size": 1, "grad_accum": 1, "steps_per_epoch": 1, "max_eval": 1, "max_train": 1,
                 "max_predict": 1, "stop_after_steps": 1, "extra_batches": 0, "eval_every": 0, "checkpoint_every": 0,
                 "max_tokens": 1, "seed": 0, "weight_decay": 0}  # fmt: skip


def opt(
    help: str,
    *,
    resume: str = "match",
    choices: tuple[str, ...] | None = None,
    flags: tuple[str, ...] = (),
    metavar: str | None = None,
    hidden: bool = False,
    default: Any = None,
    factory: Any = None,
) -> Any:
    """A :class:`TrainArgs` field: ``help``, ``resume`` (``"match"``: must equal the saved run's value on
    ``--resume``; :data:`MAY`: may change), argparse ``choices``/``metavar``, extra ``flags`` spellings and
    ``hidden`` (left out of ``--help``: test-only options); the argparse type is the field's annotation."""
    assert resume in ("match", MAY), resume
    meta = {"help": help, "resume": resume, "choices": choices, "flags": flags,
            "metavar": metavar, "hidden": hidden}  # fmt: skip
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def option_flag(name: str) -> str:
    """The command-line spelling of option ``name`` (``pal_lr`` -> ``--pal-lr``)."""
    return "--" + name.replace("_", "-")


def jsonable(value: Any) -> Any:
    """``value`` as JSON data: lists and tuples as lists, str/int/float/bool/None as they are, else ``str``."""
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


@dataclass
class TrainArgs:
    """The options of one training run (``python train.py --help`` shows them with their help)."""

    ds_config: str = opt(
        "DeepSpeed JSON config (precision, ZeRO stage, gradient clipping): a path, or the name of a shipped one "
        "(cpu_auto.json, the default: bf16 where the CPU has native bf16, else fp32; cpu_bf16.json, cpu_fp32.json, "
        "gpu_{bf16,fp16}_zero{0,1,2}.json; also as configs/<name>). Its batch and "
        "accumulation entries must agree with --batch-size and --grad-accum (missing ones are filled in); "
        "optimizer and scheduler come from the options",
        resume=MAY, flags=("--ds_config", "--ds-config"), default=DEFAULT_DS_CONFIG,
    )  # fmt: skip
    model: str = opt(
        "encoder checkpoint: 'minilm-l6' (offline all-MiniLM-L6-v2), a folder with config.json + "
        "model.safetensors/pytorch_model.bin + tokenizer.json (or vocab.txt), or a Hugging Face hub name",
        default="minilm-l6",
    )  # fmt: skip
    tasks: str = opt(
        f"comma-separated tasks: built-in names ({', '.join(TASKS)}) and task files (path/to/task.json, see the "
        "README's 'Your own task')", default="sst,para,sts",
    )  # fmt: skip
    data_dir: str | None = opt(
        f"folder of the task CSV files (default: ${DATA_DIR_ENV})", resume=MAY, metavar="DIR"
    )
    epochs: int = opt("training epochs", default=3)
    steps_per_epoch: int | None = opt(
        "optimizer updates per epoch (default: 2400 as in Bert-n-Pals; with round_robin: one full pass over "
        "every task's batches, which a number cuts short)",
    )
    batch_size: int | None = opt(
        "examples per micro-batch (of one task with --batching per_task; default: the config's "
        "train_micro_batch_size_per_gpu, else 32)",
    )
    lr: float = opt("peak learning rate of the BERT encoder weights", default=2e-5)
    pal_lr: float | None = opt("peak learning rate of the PAL parameters (default: --lr)")
    head_lr: float | None = opt("peak learning rate of the task heads (default: --lr)")
    warmup: float = opt(
        "fraction of all updates with a linear warm-up from 0; then linear decay to 0", default=0.1
    )
    optimizer: str = opt(
        "adamw (betas 0.9/0.999, eps 1e-6), sgd (momentum 0.9) or rmsprop",
        choices=OPTIMIZERS,
        default="adamw",
    )
    weight_decay: float = opt("decoupled weight decay; never on biases and LayerNorms", default=0.01)
    max_length: int = opt("tokens per sequence (a pair counts together), <= 512", default=128)
    seed: int = opt("seed of weights init, sampling, batch order and dropout", default=0)
    out: str = opt(
        "output folder (metrics, checkpoints, best model, results); one that holds an earlier run is refused "
        "unless --resume or --overwrite", resume=MAY, default="runs/default",
    )  # fmt: skip
    resume: bool = opt(
        "continue the run in --out from its last checkpoint, with its saved options (give only those that may "
        "change)", resume=MAY, default=False,
    )  # fmt: skip
    overwrite: bool = opt(
        "replace the earlier run in --out: its outputs (metrics, checkpoints, best/, TensorBoard events, plots) "
        "move aside to --out/.replaced-<pid>/ and are deleted once the new run has its first checkpoint; a new run "
        "that fails before that puts them back",
        resume=MAY, default=False,
    )  # fmt: skip
    sampling: str = opt(
        "which task each micro-batch comes from (see fastpals.data.sampling)", choices=SAMPLING_METHODS,
        default="annealed",
    )  # fmt: skip
    batching: str = opt(
        "mixed: every micro-batch mixes the tasks (shares from --sampling) and is packed without padding, one "
        "forward and one backward per micro-batch (with --surgery too); per_task: every micro-batch holds one "
        "task, padded (the seed systems' recipes)",
        choices=BATCHINGS, default="mixed",
    )  # fmt: skip
    max_tokens: int | None = opt(
        "mixed batching: a token budget per micro-batch instead of --batch-size (rows are never split; a row "
        "longer than the budget is an error)",
    )
    task_weighting: str = opt(
        "mixed batching: the micro-batch loss is each task's mean loss weighted by its share of the examples "
        "(examples: the example-weighted mean, as per-task micro-batches averaged by share) or equally (equal)",
        choices=TASK_WEIGHTINGS, default="examples",
    )  # fmt: skip
    surgery: str = opt(
        "surgery: the aggregator that combines the per-task gradients of the shared weights in each update",
        choices=SURGERIES, default="none",
    )  # fmt: skip
    surgery_opts: list[str] = opt(
        "an option of the --surgery aggregator, KEY=VALUE, repeatable (e.g. c=0.4 for cagrad, alpha=2 for fairgrad; "
        "see fastpals.surgery.make_weighting)",
        metavar="KEY=VALUE", factory=list, flags=("--surgery-opt", "--surgery-opts"),
    )  # fmt: skip
    surgery_buffer_dtype: str = opt(
        "storage dtype of the per-task gradient rows of the shared parameters: auto (the training precision: "
        "bf16 rows when the DeepSpeed config trains in bf16, else fp32), fp32, or bf16 (half the memory; the "
        "Gram and the combination still accumulate in fp32)",
        choices=SURGERY_BUFFER_DTYPES, default="auto",
    )  # fmt: skip
    surgery_memory: str = opt(
        "--batching mixed surgery: buffer (the [tasks, shared parameters] rows), stream (no such rows: the Gram "
        "layer by layer in the one backward, the update by one weight-gradient GEMM per layer; memory flat in "
        "the tasks), or auto (the buffer where its predicted peak fits this device with a margin and its rows are "
        "at most the activations, else streaming with, per layer, the rows kept where smaller than that layer's "
        "kept activations; see fastpals.train.memory_mode)",
        choices=SURGERY_MEMORIES, default="buffer",
    )  # fmt: skip
    pal: str = opt(
        f"PAL variant: {_PAL_HELP}", choices=tuple(PAL_PRESETS), default="default",
    )  # fmt: skip
    pal_heads: int | None = opt("attention heads inside each PAL (overrides the preset)")
    pal_hidden: int | None = opt("PAL width d_s (overrides the preset)")
    pal_layers: int | None = opt("PALs in the top N encoder layers only (overrides the preset)")
    head: str = opt("task head on the pooled features", choices=("linear", "mlp"), default="linear")
    pair_mode: str = opt(
        "pair tasks: joint cross-encoder, or siamese (SBERT) with cosine similarity (STS; Quora then uses "
        "sbert_concat) or with (u, v, |u-v|) into the head",
        choices=("joint", "sbert_cosine", "sbert_concat"), default="joint",
    )  # fmt: skip
    grad_accum: int | None = opt(
        "micro-batches per update without surgery (default: the config's gradient_accumulation_steps, else 1)",
    )
    extra_batches: int = opt("annealed batches per update of every_task_plus_annealed", default=1)
    eval_every: int = opt(
        "also evaluate on dev every N updates (0: at epoch ends only)", resume=MAY, default=0
    )
    checkpoint_every: int = opt(
        "also write a resumable checkpoint every N updates inside an epoch (0: at epoch ends only); a kill "
        "(kill -9, out of memory, power cut) loses at most N updates: --resume continues from the last one, "
        "bit-identical to an uninterrupted run. The default, 100, is about 70 s of `make train` on a 2-core CPU",
        resume=MAY, default=100,
    )  # fmt: skip
    eval_at_start: bool = opt("evaluate the untrained model (step 0) first", resume=MAY, default=False)
    max_eval: int | None = opt(
        "use at most N dev examples per task (a fixed random subset, the same in every run) for quick runs",
        resume=MAY,
    )  # fmt: skip
    max_train: int | None = opt("use at most N training examples per task (quick runs)")
    max_predict: int | None = opt("predict at most N test examples per task (quick runs)", resume=MAY)
    freeze_bert: bool = opt("train only PALs, heads and LayerNorms", default=False)
    activation_checkpointing: bool = opt(
        "recompute each encoder layer in the backward instead of keeping its activations (non-reentrant "
        "torch.utils.checkpoint): less memory for a larger batch, about one more forward of the layers per step; "
        "the same gradients (with PALs and with one-backward --surgery)",
        default=False,
    )
    freeze_word_embeddings: bool = opt(
        "keep the word-embedding matrix fixed (on MiniLM half the weights: no gradient or optimizer work)",
        default=False,
    )
    freeze_layers: int = opt(
        "freeze the embeddings and the bottom K encoder layers: no gradient, and the backward stops at layer K "
        "(PALs must sit above them: --pal-layers)", default=0,
    )  # fmt: skip
    no_progress: bool = opt("no progress bars", resume=MAY, default=False)
    verbose: bool = opt(
        "show DeepSpeed's INFO and memory logging and the libraries' warnings (quiet by default)", resume=MAY,
        default=False,
    )  # fmt: skip
    debug: bool = opt("show the Python traceback of an error, not only its one-line message", resume=MAY,
                      default=False)  # fmt: skip
    local_rank: int | None = opt(
        "set by the deepspeed launcher; do not pass by hand", resume=MAY,
        flags=("--local_rank", "--local-rank"),
    )  # fmt: skip
    stop_after_steps: int | None = opt(
        "testing: send this process SIGTERM after N updates (checkpoint and stop, as a real kill would)",
        resume=MAY,
    )  # fmt: skip
    inject_nan_at_step: int | None = opt("testing: NaN loss at this update", resume=MAY, hidden=True)
    inject_nan_weights_at_step: int | None = opt(
        "testing: NaN in the weights after this update", resume=MAY, hidden=True
    )
    kill_after_steps: int | None = opt(
        "testing: SIGKILL this process after N updates (no checkpoint, as kill -9 would)", resume=MAY,
        hidden=True,
    )  # fmt: skip

    # derived in __post_init__ (not options)
    task_list: list[str] = field(init=False, repr=False, default_factory=list)
    task_specs: dict[str, TaskSpec] = field(init=False, repr=False, default_factory=dict)
    data_path: Path | None = field(init=False, repr=False, default=None)  # None: task files only
    pal_config: PALConfig | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        try:
            specs = resolve_tasks(str(self.tasks))
        except ValueError as err:  # an unknown name, a task twice, or a bad task file: one line
            raise ConfigError(f"--tasks: {err}") from None
        self.task_specs = {spec.name: spec for spec in specs}
        tasks = self.task_list = list(self.task_specs)
        for name, f in OPTIONS.items():
            if f.metadata["choices"] and getattr(self, name) not in f.metadata["choices"]:
                raise ConfigError(
                    f"{option_flag(name)} {getattr(self, name)!r}: choose one of {', '.join(f.metadata['choices'])}"
                )
        if self.surgery == "none" and (self.surgery_opts or self.surgery_buffer_dtype != "auto"):
            raise ConfigError("--surgery-opt and --surgery-buffer-dtype need a --surgery method")
        if self.surgery_memory == "stream" and (self.surgery == "none" or self.batching != "mixed"):
            raise ConfigError(
                "--surgery-memory stream needs a --surgery method and --batching mixed (one backward per "
                "update); per-task batches use the buffer: drop --surgery-memory or use --batching mixed"
            )
        if self.surgery_memory == "stream" and getattr(AGGREGATORS.get(self.surgery), "reads_rows", False):
            raise ConfigError(
                f"--surgery {self.surgery} reads the [tasks, shared parameters] gradient rows, which "
                "--surgery-memory stream does not keep: use --surgery-memory buffer (or auto)"
            )
        if self.surgery_memory == "stream" and self.surgery_buffer_dtype == "bf16":
            raise ConfigError(
                "--surgery-buffer-dtype sets the buffer's rows; --surgery-memory stream has none: "
                "drop one of them"
            )
        if self.surgery != "none":
            try:
                make_weighting(self.surgery, **parse_surgery_options(self.surgery_opts))
            except ValueError as err:
                raise ConfigError(str(err)) from None
        if self.batch_size is None or self.grad_accum is None:
            ds = load_ds_config(self.ds_config)
            if self.batch_size is None:
                self.batch_size = ds.get("train_micro_batch_size_per_gpu", 32)
            if self.grad_accum is None:
                self.grad_accum = 1 if self.surgery != "none" else ds.get("gradient_accumulation_steps", 1)
        for name, low in _LOWER_BOUNDS.items():
            value = getattr(self, name)
            if value is None and OPTIONS[name].default is None:
                continue
            if value is None or value < low:
                raise ConfigError(f"{option_flag(name)} must be >= {low}, got {value}")
        if not 8 <= self.max_length <= 512:
            raise ConfigError(f"--max-length must be in [8, 512], got {self.max_length}")
        for name in ("lr", "pal_lr", "head_lr"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{option_flag(name)} must be a positive number, got {value}")
        if not 0.0 <= self.warmup < 1.0:
            raise ConfigError(f"--warmup is a fraction of the updates in [0, 1), got {self.warmup}")
        if self.surgery != "none" and self.grad_accum != 1:
            raise ConfigError(
                "--surgery groups the micro-batches of an update by itself (see --sampling); use --grad-accum 1"
            )
        if self.surgery != "none" and len(tasks) < 2:
            raise ConfigError("--surgery needs at least two --tasks")
        per_task = self.batching == "per_task"
        if per_task:
            if self.max_tokens is not None:
                raise ConfigError(
                    "--max-tokens needs --batching mixed (per-task micro-batches use --batch-size)"
                )
            if self.task_weighting != "examples":
                raise ConfigError(
                    "--task-weighting weighs tasks inside a mixed micro-batch: use --batching mixed"
                )
        if self.sampling in GROUPED_METHODS and per_task and self.surgery == "none" and self.grad_accum != 1:
            raise ConfigError(
                f"--sampling {self.sampling} sets the micro-batches of an update; use --grad-accum 1"
            )
        if self.pair_mode == "sbert_cosine" and "sts" not in tasks:
            raise ConfigError("--pair-mode sbert_cosine is for STS (regression); add sts or use sbert_concat")
        self.pal_config = build_pal_config(self)
        if self.freeze_bert and self.pal_config is None:
            raise ConfigError(
                "--freeze-bert with --pal none would train only the heads and LayerNorms; pick a --pal"
            )
        if Path(self.out).exists() and not Path(self.out).is_dir():
            raise ConfigError(f"--out {self.out} is a file, not a folder: choose another --out")
        builtin = [t for t, spec in self.task_specs.items() if spec.source is None]  # task files: their own
        if builtin and self.data_dir is None and not os.environ.get(DATA_DIR_ENV):
            raise ConfigError(
                f"no data folder: pass --data-dir /path/to/the/task/files or `export {DATA_DIR_ENV}=/path/to/"
                f"the/task/files`"
            )
        try:
            data_path = resolve_data_dir(self.data_dir) if builtin else None
            paths = [
                split_path(self.task_specs[t], s, data_path) for t in self.task_list for s in ("train", "dev")
            ]
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"--data-dir: {err}") from None
        for p in paths:
            problem = _file_problem(p)
            if problem is not None:
                raise ConfigError(
                    f"data file {p} {problem} (check --data-dir / ${DATA_DIR_ENV} or the task file)"
                )
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ConfigError(
                f"missing data file(s): {', '.join(missing)} (check --data-dir / ${DATA_DIR_ENV})"
            )
        self.data_path = data_path

    def options(self) -> dict[str, Any]:
        """The options (not the derived fields) as JSON-ready values: what ``train_args.json`` holds."""
        return {name: jsonable(getattr(self, name)) for name in OPTIONS}

    def resume_options(self) -> dict[str, Any]:
        """The options that must match the saved run's on ``--resume``."""
        return {name: jsonable(getattr(self, name)) for name in resume_fields("match")}


def _file_problem(path: Path) -> str | None:
    """What keeps ``path`` from being read as a data file (a folder, a symbolic-link loop, no read permission),
    or None (a readable file, or a missing one, which the caller reports with the others)."""
    if path.is_dir():
        return "is a folder, not a file"
    try:
        with open(path, "rb"):
            return None
    except FileNotFoundError:
        return None if not path.is_symlink() else "is a symbolic link to nothing"
    except OSError as err:
        return f"cannot be read ({err.strerror or type(err).__name__})"


#: the option fields of :class:`TrainArgs` by name, in declaration order
OPTIONS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainArgs) if f.init}
#: the argparse type of each option, from its annotation (``"int | None"``: int; None for flags and lists)
OPTION_TYPES = {
    name: {"int": int, "float": float, "str": str}.get(f.type.split()[0]) for name, f in OPTIONS.items()
}


def resume_fields(kind: str) -> list[str]:
    """Names of the options whose ``resume`` flag is ``kind`` (``"match"`` or ``"may_change"``)."""
    return [name for name, f in OPTIONS.items() if f.metadata["resume"] == kind]


def type_problem(f: dataclasses.Field, value: Any) -> str | None:
    """None when the JSON ``value`` has the type of option ``f``, else what it must be (``"an integer"``, ...)."""
    kind = OPTION_TYPES[f.name]
    if value is None and f.default is None:
        return None
    if f.default is False:
        ok, want = isinstance(value, bool), "true or false"
    elif f.name == "surgery_opts":
        ok, want = isinstance(value, list) and all(isinstance(v, str) for v in value), "a list of strings"
    elif kind is float:
        ok, want = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif kind is int:
        ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
    else:
        ok, want = isinstance(value, str), "a string"
    return None if ok else want


def build_pal_config(args: TrainArgs) -> PALConfig | None:
    """The :class:`PALConfig` of ``--pal`` with ``--pal-heads`` / ``--pal-hidden``; None for ``--pal none``."""
    preset = PAL_PRESETS[args.pal]
    given = {"num_heads": args.pal_heads, "hidden": args.pal_hidden, "layers": args.pal_layers}
    given = {k: v for k, v in given.items() if v is not None}
    if preset is None:
        if given:
            raise ConfigError(
                "--pal-heads/--pal-hidden/--pal-layers need PALs: drop them or choose a --pal variant"
            )
        return None
    if given.get("layers", 1) < 1:
        raise ConfigError(f"--pal-layers {args.pal_layers}: give the number of top layers with PALs (>= 1)")
    cfg = PALConfig(num_tasks=len(args.task_list), **{**preset, **given})
    if cfg.hidden < 1 or cfg.num_heads < 1 or cfg.hidden % cfg.num_heads:
        raise ConfigError(
            f"--pal-heads {cfg.num_heads} does not divide the PAL width d_s = {cfg.hidden} (--pal-hidden): "
            f"choose heads that divide d_s, e.g. {', '.join(str(h) for h in range(1, 13) if cfg.hidden % h == 0)}"
        )
    problem = cfg.pal_variant.cli_check(cfg, args.pal)
    if problem is not None:
        raise ConfigError(problem)
    return cfg


RECIPE_INFO_KEYS = ("description", "source")  # the keys of a recipe that are not options
_RECIPES = Path(str(resources.files("fastpals") / "configs" / "recipes"))


def recipe_names() -> list[str]:
    """The shipped recipes' names, sorted (file names without ``.json``)."""
    return sorted(p.stem for p in _RECIPES.glob("*.json"))


def _read_recipe(name: str) -> tuple[Path, dict[str, Any]]:
    """The path and JSON object of recipe ``name``, a shipped name or a path to a ``.json`` file; anything
    else is a one-line :class:`ConfigError` listing the shipped names."""
    if name in recipe_names():
        path = _RECIPES / f"{name}.json"
    elif (path := Path(name)).suffix != ".json" or not path.is_file():
        raise ConfigError(f"--recipe {name!r}: no such recipe; shipped recipes: {', '.join(recipe_names())}")
    return path, read_json_object(path, "--recipe ", "a recipe is a JSON object of TrainArgs options")


def recipe_info(name: str) -> dict[str, str]:
    """``{"description": ..., "source": ...}`` of a recipe (empty strings where missing)."""
    return {k: str(_read_recipe(name)[1].get(k, "")) for k in RECIPE_INFO_KEYS}


def load_recipe(name: str) -> dict[str, Any]:
    """The options of recipe ``name`` (shipped name or JSON path) as ``{TrainArgs field: value}``; a key that
    is not an option or a value of the wrong JSON type is a one-line :class:`ConfigError` naming the file and
    the key."""
    path, data = _read_recipe(name)
    options = {}
    for key, value in data.items():
        if key in RECIPE_INFO_KEYS:
            continue
        if key not in OPTIONS:
            raise ConfigError(
                f"--recipe {path}: key {key!r} is not a training option (the keys are TrainArgs field names, "
                f"e.g. pal, surgery, pair_mode, or {', '.join(RECIPE_INFO_KEYS)})"
            )
        if key in ("resume", "overwrite", "local_rank", "stop_after_steps", "inject_nan_at_step"):
            raise ConfigError(f"--recipe {path}: key {key!r} belongs to one command, not to a recipe")
        if type_problem(OPTIONS[key], value) is not None:
            raise ConfigError(f"--recipe {path}: key {key!r} has a value of the wrong type: {value!r}")
        options[key] = value
    return options
