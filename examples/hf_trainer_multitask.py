"""Train SST-5 and STS-B together inside the Hugging Face ``transformers.Trainer``, with PALs and PCGrad.

    FASTPALS_DATA_DIR=/path/to/csvs python examples/hf_trainer_multitask.py [--max-steps 150] [--surgery pcgrad]

What it shows:

1. ``MultiTaskBert.from_base("minilm-l6", ["sst", "sts"], PALConfig(...))``: the embedded MiniLM encoder with one
   set of PALs per task and a head per task;
2. ``fastpals.integrations.transformers.MultiTaskTrainer``: a ``transformers.Trainer`` whose micro-batches mix
   both tasks (fastpals' annealed sampler, packed without padding) and whose update is PCGrad (any fastpals
   aggregator: ``--surgery gem``, ``upgrad``, ``mgda``, ...) from ONE backward per micro-batch; the optimizer,
   schedule and clipping are the Trainer's (``TrainingArguments``);
3. the dev scores with fastpals' own evaluation, and the model saved by ``trainer.save_model`` as a fastpals folder
   (``MultiTaskBert.from_pretrained`` opens it; ``fastpals export`` turns its STS path into a
   sentence-transformers model when STS was trained as a siamese cosine task).

The defaults (150 updates of 16 examples, 2000 training examples per task, 400 dev examples) run in under
3 minutes on a CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import transformers

from fastpals import MultiTaskBert, PALConfig, Tokenizer
from fastpals.data import TaskBatcher
from fastpals.integrations.transformers import MultiTaskTrainer
from fastpals.model.evaluate import EVAL_BATCH, evaluate, load_split

TASKS = ("sst", "sts")


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="minilm-l6", help="a BERT checkpoint: minilm-l6, a folder, a Hub name"
    )
    parser.add_argument("--data-dir", default=None, help="the task files (default: $FASTPALS_DATA_DIR)")
    parser.add_argument("--out", default="runs/hf_trainer", help="output folder (model/, dev_scores.json)")
    parser.add_argument("--max-steps", type=int, default=150, help="optimizer updates")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per mixed micro-batch")
    parser.add_argument("--max-train", type=int, default=2000, help="training examples per task (0: all)")
    parser.add_argument("--max-eval", type=int, default=400, help="dev examples per task (0: all)")
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--surgery", default="pcgrad", help="a fastpals aggregator name, or none")
    parser.add_argument("--pal-hidden", type=int, default=204)
    parser.add_argument("--pal-heads", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    data_dir = Path(args.data_dir) if args.data_dir else None
    out = Path(args.out)

    tokenizer = Tokenizer.from_pretrained(args.model)
    model = MultiTaskBert.from_base(
        args.model, list(TASKS), PALConfig(hidden=args.pal_hidden, num_heads=args.pal_heads)
    )

    def log(line: str) -> None:
        print(line, flush=True)

    train = {
        t: TaskBatcher(
            load_split(t, "train", data_dir, args.max_train, log, sample=True),
            tokenizer,
            t,
            args.batch_size,
            max_length=args.max_length,
            seed=args.seed * 1000 + i,
        )  # fmt: skip
        for i, t in enumerate(TASKS)
    }
    dev = {
        t: TaskBatcher(
            load_split(t, "dev", data_dir, args.max_eval, log, sample=True),
            tokenizer,
            t,
            EVAL_BATCH,
            max_length=args.max_length,
            shuffle=False,
            bucket_by_length=False,
        )  # fmt: skip
        for t in TASKS
    }
    training_args = transformers.TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, warmup_steps=max(1, args.max_steps // 10), weight_decay=0.01, max_grad_norm=1.0,
        seed=args.seed, use_cpu=True, report_to=[], save_strategy="no", logging_steps=max(1, args.max_steps // 5),
        disable_tqdm=True,
    )  # fmt: skip
    trainer = MultiTaskTrainer(
        model, training_args, train, sampling="annealed", surgery=args.surgery, processing_class=tokenizer
    )
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    scores, _ = evaluate(model, dev, list(TASKS))
    trainer.save_model(str(out / "model"))  # with vocab.txt; the max length for fastpals predict / export:
    (out / "model" / "training_args.json").write_text(json.dumps({"max_length": args.max_length}))
    (out / "dev_scores.json").write_text(json.dumps(scores, indent=2))
    print(
        f"{args.max_steps} updates ({args.surgery}) in {seconds:.0f} s; dev: "
        + ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
        + f"; model in {out / 'model'}"
    )
    return scores


if __name__ == "__main__":
    main()
