"""``fastpals predict MODEL_DIR``: a saved multi-task model on the CS224N test files, or on ``--text`` /
``--pair`` sentences (printed tab-separated: task, prediction, label name, probability or score, text)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

from fastpals.data.loading import DATA_DIR_ENV, load_task, split_path
from fastpals.data.metrics import write_predictions
from fastpals.data.per_task_batches import TaskBatcher
from fastpals.data.readers import PairExample, SentenceExample
from fastpals.data.tokenizer import Tokenizer
from fastpals.model.evaluate import EVAL_BATCH, predict_batches
from fastpals.model.multitask import MultiTaskBert

__all__ = ["LABEL_NAMES", "build_parser", "load_for_prediction", "main", "predict_examples"]

# names of the built-in tasks' labels (class index -> name)
LABEL_NAMES = {
    "sst": ("very negative", "negative", "neutral", "positive", "very positive"),
    "cfimdb": ("negative", "positive"),
    "para": ("not duplicate", "duplicate"),
}


class PredictError(ValueError):
    """Something the user can fix; printed as one line."""


def load_for_prediction(model_dir: str | Path, force: bool = False) -> tuple[MultiTaskBert, object, dict]:
    """``(model in eval mode, tokenizer, training args)`` of a saved model folder. ``force``: accept an adapter
    beside an encoder other than the one it was trained with (:mod:`fastpals.encoder.fingerprint`)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir} is not a folder (give the trainer's <out>/best)")
    model = MultiTaskBert.load(model_dir, force=force).eval()
    flags = [torch.isfinite(p).all() for p in model.parameters()]
    if flags and not bool(torch.stack(flags).all()):  # one check, one host read
        raise PredictError(
            f"{model_dir} holds non-finite weights (NaN/inf): its predictions would be meaningless; use a model "
            f"saved by a run that finished (train.py never saves non-finite weights)"
        )
    train_args_path = model_dir / "training_args.json"
    train_args = json.loads(train_args_path.read_text()) if train_args_path.is_file() else {}
    if any((model_dir / name).is_file() for name in ("tokenizer.json", "vocab.txt")):
        tokenizer = Tokenizer.from_pretrained(model_dir)
    elif model.config.base_model:
        tokenizer = Tokenizer.from_pretrained(model.config.base_model)
    else:
        raise FileNotFoundError(
            f"{model_dir} has no tokenizer.json or vocab.txt and its config names no base model"
        )
    return model, tokenizer, train_args


def predict_examples(
    model: MultiTaskBert,
    tokenizer: object,
    task: str,
    examples: list,
    max_length: int = 128,
    batch_size: int = EVAL_BATCH,
    progress: bool = False,
    with_confidence: bool = False,
) -> tuple[list[str], np.ndarray] | tuple[list[str], np.ndarray, np.ndarray | None]:
    """``(ids, float64 [N])`` predictions for ``examples`` of ``task`` (class index or STS score);
    ``with_confidence`` adds each predicted label's probability (float32 ``[N]``, None for regression)."""
    index = model.task_index(task)
    spec = model.tasks[index]
    batcher = TaskBatcher(
        examples, tokenizer, spec, batch_size, max_length=max_length, shuffle=False, bucket_by_length=False,
        pair_encoding="separate" if spec.siamese else "joint",
    )  # fmt: skip
    ids, preds, _, conf = predict_batches(
        model, batcher, index, progress, desc=f"predict {task}", with_confidence=True
    )
    return (ids, preds.astype(np.float64), conf) if with_confidence else (ids, preds.astype(np.float64))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastpals predict", description="Predict with a trained fastpals multi-task model."
    )
    arg = p.add_argument
    arg("model_dir", help="folder written by the trainer (<out>/best) or MultiTaskBert.save_pretrained")
    arg("--task", help="task for --text/--pair (one of the model's tasks)")
    arg("--text", action="append", default=[], help="a sentence to classify (repeatable)")
    arg("--pair", nargs=2, action="append", default=[], metavar=("A", "B"), help="a sentence pair")
    arg("--data-dir", help=f"folder of the test files (default ${DATA_DIR_ENV})")
    arg("--out", help="folder for prediction files (default <model_dir>/../predictions)")
    arg("--max-length", type=int, help="tokens per sequence (default: as trained)")
    arg("--no-progress", action="store_true", help="no progress bars")
    arg(
        "--force",
        action="store_true",
        help="load the adapter even beside an encoder other than the one it was trained with",
    )
    arg("--debug", action="store_true", help="show the traceback of an error")
    return p


def _refuse_nonfinite(task: str, preds: np.ndarray, conf: np.ndarray | None) -> None:
    """One line instead of ``p=nan``: the model gave NaN/inf outputs."""
    bad = int((~np.isfinite(preds)).sum() + (0 if conf is None else (~np.isfinite(conf)).sum()))
    if bad:
        raise PredictError(
            f"the model gave {bad} non-finite output(s) (NaN/inf) for task {task}: no predictions written; the "
            f"model is broken (use another checkpoint)"
        )


def _label(spec: object, value: float, confidence: float | None) -> str:
    if confidence is None:
        return f"score\t{value:.3f}"
    names = getattr(spec, "label_names", None) or LABEL_NAMES.get(getattr(spec, "name", ""))
    name = names[int(value)] if names and 0 <= int(value) < len(names) else f"class {int(value)}"
    return f"{name}\tp={confidence:.3f}"


def _sentences(args: argparse.Namespace, model: MultiTaskBert, tokenizer: object, max_length: int) -> None:
    if args.task is None or args.task not in model.task_names:
        raise PredictError(f"--task must be one of {model.task_names}")
    spec = model.tasks[model.task_index(args.task)]
    pair = spec.pair
    if pair and args.text or not pair and args.pair:
        raise PredictError(f"task {args.task} takes {'--pair A B' if pair else '--text'}")
    if pair:
        examples = [PairExample(f"cli{i}", a, b) for i, (a, b) in enumerate(args.pair)]
    else:
        examples = [SentenceExample(f"cli{i}", s) for i, s in enumerate(args.text)]
    _, preds, conf = predict_examples(model, tokenizer, args.task, examples, max_length, with_confidence=True)
    _refuse_nonfinite(args.task, preds, conf)
    for i, (example, value) in enumerate(zip(examples, preds)):
        shown = example.sentence if not pair else f"{example.sentence1} ||| {example.sentence2}"
        print(f"{args.task}\t{value:.4g}\t{_label(spec, value, None if conf is None else conf[i])}\t{shown}")


def _test_files(args: argparse.Namespace, model: MultiTaskBert, tokenizer: object, max_length: int) -> None:
    builtin = any(spec.source is None for spec in model.tasks)  # task files name their own test files
    if builtin and args.data_dir is None and not os.environ.get(DATA_DIR_ENV):
        raise PredictError(
            f"no data folder: pass --data-dir /path/to/the/test/files or `export {DATA_DIR_ENV}=...`"
        )
    data_dir = Path(args.data_dir or os.environ[DATA_DIR_ENV]) if builtin else None
    if data_dir is not None and not data_dir.is_dir():
        raise PredictError(f"--data-dir {data_dir} is not a folder")
    out = Path(args.out) if args.out else Path(args.model_dir).resolve().parent / "predictions"
    if out.exists() and not out.is_dir():
        raise PredictError(f"--out {out} is a file, not a folder: choose another --out")
    for spec in model.tasks:
        task = spec.name
        if "test" not in spec.files:
            print(f"[predict] {task}: no test file in this data set, skipped", file=sys.stderr)
            continue
        path = split_path(spec, "test", data_dir)
        if not path.is_file():
            raise PredictError(f"{path} does not exist (check --data-dir)")
        examples = load_task(spec, "test", data_dir, strict=False)
        ids, preds, conf = predict_examples(
            model, tokenizer, task, examples, max_length, progress=not args.no_progress, with_confidence=True
        )
        _refuse_nonfinite(task, preds, conf)
        values = preds.astype(np.int64) if spec.integer_labels else preds
        path = write_predictions(out / f"{task}-test-output.csv", ids, values, spec)
        print(f"[predict] {task}: {len(ids)} predictions -> {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        model, tokenizer, train_args = load_for_prediction(args.model_dir, force=args.force)
        max_length = args.max_length or train_args.get("max_length", 128)
        if args.text or args.pair:
            _sentences(args, model, tokenizer, max_length)
        else:
            _test_files(args, model, tokenizer, max_length)
    except (PredictError, FileNotFoundError, ValueError) as err:
        if args.debug:
            traceback.print_exc()
        print(f"fastpals predict: error: {err}" + ("" if args.debug else " (--debug shows the traceback)"),
              file=sys.stderr)  # fmt: skip
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
