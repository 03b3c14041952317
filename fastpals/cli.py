"""The ``fastpals`` command: ``fastpals train ...`` (= ``python train.py ...``), ``fastpals predict ...``
(= ``python -m fastpals.commands.predict ...``), ``fastpals env`` (= ``python -m fastpals.env``),
``fastpals compare RECIPE... --budget STEPS`` (several recipes on one budget: :mod:`fastpals.commands.compare`),
``fastpals memory ...`` (the predicted peak memory of a training step: :mod:`fastpals.commands.memory`),
``fastpals export ...`` (one task in another library's format: :mod:`fastpals.commands.export`), ``fastpals claims`` (the
five reports' findings re-run over several seeds: :mod:`fastpals.commands.claims`)."""

from __future__ import annotations

import sys

__all__ = ["main"]

USAGE = """usage: fastpals {train,predict,env,compare,claims,memory,export} [options]

  train     multi-task fine-tuning with DeepSpeed (same options as train.py; `fastpals train --help`)
  predict   run a trained model on the test files or on given sentences (`fastpals predict --help`)
  env       versions, devices and kernel back-ends of this installation
  compare   train several recipes on the same budget and data; a table and a bar chart
            (`fastpals compare --help`)
  claims    re-run the five reports' findings over several seeds; which hold, with 95% intervals
            (`fastpals claims --help`)
  memory    predict the peak memory of a training step and what fits a T4 / A100 / H100 / this CPU
            (traced on fake tensors, offline; `fastpals memory --help`)
  export    one task of a trained model as a sentence-transformers model (`fastpals export --help`)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    # each command imports its own modules (the trainer: DeepSpeed) only when it runs
    if command == "train":
        from fastpals.train import main as train_main

        return train_main(rest)
    if command == "predict":
        from fastpals.commands.predict import main as predict_main

        return predict_main(rest)
    if command == "env":
        from fastpals.env import main as env_main

        return env_main(rest)
    if command == "compare":
        from fastpals.commands.compare import main as compare_main

        return compare_main(rest)
    if command == "claims":
        from fastpals.commands.claims import main as claims_main

        return claims_main(rest)
    if command == "memory":
        from fastpals.commands.memory_cli import main as memory_main

        return memory_main(rest)
    if command == "export":
        from fastpals.commands.export import main as export_main

        return export_main(rest)
    print(f"fastpals: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    sys.exit(main())
