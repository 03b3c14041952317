"""``fastpals export --task TASK --format sentence-transformers MODEL_DIR OUT``: one task of a trained model in
another library's format (:mod:`fastpals.integrations.sentence_transformers`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastpals.commands.predict import load_for_prediction

__all__ = ["FORMATS", "build_parser", "main"]

FORMATS = ("sentence-transformers",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastpals export", description="Write one task of a trained model in another library's format."
    )
    parser.add_argument("model_dir", help="a saved model folder (the trainer's <out>/best)")
    parser.add_argument("out", help="the folder to write (must not exist, or be empty, unless --overwrite)")
    parser.add_argument("--task", required=True, help="the task to export (e.g. sts)")
    parser.add_argument("--format", required=True, choices=FORMATS, help="the output format")
    parser.add_argument("--max-length", type=int, help="tokens per text (default: the run's)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace the files of a non-empty out folder"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; errors the user can fix are one line on stderr and exit status 2."""
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
            raise ValueError(f"{out} exists and is not empty: give another folder, or --overwrite")
        if args.max_length is not None and not 2 <= args.max_length <= 512:
            raise ValueError(f"--max-length {args.max_length}: give a number of tokens in [2, 512]")
        # optional: sentence-transformers
        from fastpals.integrations.sentence_transformers import check_exportable, export_task

        model, tokenizer, train_args = load_for_prediction(args.model_dir)
        check_exportable(model, args.task)
        max_length = args.max_length or train_args.get("max_length", 128)
        export_task(model, tokenizer, args.task, out, max_length)
    except (ValueError, FileNotFoundError) as err:
        print(f"fastpals export: {err}", file=sys.stderr)
        return 2
    print(
        f"wrote {out}: SentenceTransformer({str(out)!r}, trust_remote_code=True) encodes with task {args.task}"
    )
    return 0
