"""Run a trained multi-task model on the CS224N test files or on sentences given on the command line.

    python -m fastpals.predict runs/default/best                       # test files -> CS224N prediction files
    python -m fastpals.predict runs/default/best --task sst --text "a gripping, funny film"
    python -m fastpals.predict runs/default/best --task sts --pair "A man plays guitar." "Someone plays music."

(``fastpals predict ...`` is the same.) The model folder is one written by ``MultiTaskBert.save_pretrained``
(the trainer's ``<out>/best``); its tokenizer is the ``vocab.txt`` in the folder (the trainer copies it there)
or the base model's, and ``training_args.json`` (written by the trainer) gives the max length.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from fastpals.data import PairExample, SentenceExample, TaskBatcher
from fastpals.multitask import MultiTaskBert
from fastpals.tasks import TaskSpec

__all__ = ["build_parser", "describe_predictions", "load_for_prediction", "main", "predict_examples"]


def load_for_prediction(model_dir: str | Path) -> tuple[MultiTaskBert, object, dict]:
    """``(model in eval mode, tokenizer, training args)`` of a saved model folder."""
    from fastpals.tokenizer import Tokenizer

    model_dir = Path(model_dir)
    model = MultiTaskBert.load(model_dir).eval()
    train_args_path = model_dir / "training_args.json"
    train_args = json.loads(train_args_path.read_text()) if train_args_path.is_file() else {}
    if (model_dir / "vocab.txt").is_file():
        tokenizer = Tokenizer(model_dir / "vocab.txt")
    elif model.config.base_model:
        tokenizer = Tokenizer.from_pretrained(model.config.base_model)
    else:
        raise FileNotFoundError(f"{model_dir} has no vocab.txt and its config names no base model")
    return model, tokenizer, train_args


@torch.no_grad()
def predict_examples(
    model: MultiTaskBert,
    tokenizer: object,
    task: str,
    examples: list,
    max_length: int = 128,
    batch_size: int = 64,
    return_logits: bool = False,
) -> tuple[list[str], np.ndarray] | tuple[list[str], np.ndarray, np.ndarray]:
    """Predictions for ``examples`` of ``task`` in order: ``(ids, float64 [N])`` (class index, 0/1, or the
    regression score in the task's label range); with ``return_logits`` also the task's logits, float32
    ``[N, num_labels]`` (see ``describe_predictions``)."""
    index = model.task_index(task)
    spec = model.tasks[index]
    encoding = "separate" if spec.siamese else "joint"
    batcher = TaskBatcher(
        examples, tokenizer, spec, batch_size, max_length=max_length, shuffle=False, bucket_by_length=False,
        pair_encoding=encoding,
    )  # fmt: skip
    keys = (
        "input_ids",
        "attention_mask",
        "token_type_ids",
        "input_ids_b",
        "attention_mask_b",
        "token_type_ids_b",
    )
    ids, preds, logits = [], [], []
    for batch in batcher:
        inputs = {k: batch[k] for k in keys if k in batch}
        inputs["task_ids"] = torch.full((batch["input_ids"].shape[0],), index, dtype=torch.long)
        output = model(**inputs)
        preds.append(model.predict(output).double().numpy())
        logits.append(output.logits[:, : spec.num_labels].float().numpy())
        ids.extend(batch["ids"])
    if return_logits:
        return ids, np.concatenate(preds), np.concatenate(logits)
    return ids, np.concatenate(preds)


def describe_predictions(spec: TaskSpec, logits: np.ndarray) -> list[tuple[str, float]]:
    """``(label, value)`` per example from a task's logits ``[N, num_labels]`` (float): the predicted class's
    name (``spec.label_names``, else its index) and its probability (softmax; sigmoid for binary tasks), or, for
    regression, the score as text and the score."""
    logits = np.asarray(logits, dtype=np.float64)
    if spec.kind == "classification":
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = shifted / shifted.sum(axis=1, keepdims=True)
        best = probs.argmax(axis=1)
        return [(spec.label_name(int(k)), float(p[k])) for k, p in zip(best, probs)]
    if spec.kind == "binary":
        positive = 1.0 / (1.0 + np.exp(-logits[:, 0]))
        return [
            (spec.label_name(1), float(p)) if p > 0.5 else (spec.label_name(0), float(1.0 - p))
            for p in positive
        ]
    scores = np.clip(logits[:, 0], 0.0, 1.0) * spec.label_scale
    return [(f"{s:.4g}", float(s)) for s in scores]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastpals predict", description="Predict with a trained fastpals multi-task model."
    )
    p.add_argument(
        "model_dir", help="folder written by the trainer (<out>/best) or MultiTaskBert.save_pretrained"
    )
    p.add_argument("--task", help="task for --text/--pair (one of the model's tasks)")
    p.add_argument("--text", action="append", default=[], help="a sentence to classify (repeatable)")
    p.add_argument("--pair", nargs=2, action="append", default=[], metavar=("A", "B"), help="a sentence pair")
    p.add_argument("--data-dir", default=None, help="folder of the test files (default $FASTPALS_DATA_DIR)")
    p.add_argument(
        "--out", default=None, help="folder for prediction files (default <model_dir>/../predictions)"
    )
    p.add_argument("--max-length", type=int, default=None, help="tokens per sequence (default: as trained)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from fastpals.data import load_task
    from fastpals.metrics import write_predictions

    try:
        model, tokenizer, train_args = load_for_prediction(args.model_dir)
    except (FileNotFoundError, ValueError) as err:
        print(f"fastpals predict: error: {err}", file=sys.stderr)
        return 2
    max_length = args.max_length or train_args.get("max_length", 128)
    if args.text or args.pair:
        if args.task is None or args.task not in model.task_names:
            print(f"fastpals predict: error: --task must be one of {model.task_names}", file=sys.stderr)
            return 2
        spec = model.tasks[model.task_index(args.task)]
        pair = spec.pair
        if pair and args.text or not pair and args.pair:
            need = "--pair A B" if pair else "--text"
            print(f"fastpals predict: error: task {args.task} takes {need}", file=sys.stderr)
            return 2
        if pair:
            examples = [PairExample(f"cli{i}", a, b) for i, (a, b) in enumerate(args.pair)]
        else:
            examples = [SentenceExample(f"cli{i}", s) for i, s in enumerate(args.text)]
        _, preds, logits = predict_examples(
            model, tokenizer, args.task, examples, max_length, return_logits=True
        )
        described = describe_predictions(spec, logits)
        # one line per input: task, prediction (class index or score), label name and probability (or the
        # score's range), the input
        for example, pred, (label, value) in zip(examples, preds, described):
            shown = example.sentence if not pair else f"{example.sentence1} ||| {example.sentence2}"
            if spec.kind == "regression":
                low, high = spec.label_range
                print(f"{args.task}\t{pred:.4g}\tscore (labels in [{low:g}, {high:g}])\t{shown}")
            else:
                print(f"{args.task}\t{pred:.4g}\t{label} (p = {value:.3f})\t{shown}")
        return 0
    out = Path(args.out) if args.out else Path(args.model_dir).resolve().parent / "predictions"
    for spec in model.tasks:
        task = spec.name
        if "test" not in spec.files:
            print(f"[predict] {task}: no test file in this data set, skipped", file=sys.stderr)
            continue
        examples = load_task(spec, "test", args.data_dir, strict=False)
        ids, preds = predict_examples(model, tokenizer, task, examples, max_length)
        values = preds.astype(np.int64) if spec.metric == "accuracy" else preds
        path = write_predictions(out / f"{task}-test-output.csv", ids, values, spec)
        print(f"[predict] {task}: {len(ids)} predictions -> {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
