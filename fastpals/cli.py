"""The ``fastpals`` command: ``fastpals train|predict|env|compare|claims|memory|export ...``, each the ``main`` of
its module (:data:`COMMANDS`)."""

from __future__ import annotations

import importlib
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


#: the module whose ``main(argv)`` runs each command, imported only when it runs (start-up: ``fastpals env`` does
#: not load the trainer)
COMMANDS = {
    "train": "fastpals.train",
    "predict": "fastpals.commands.predict",
    "env": "fastpals.env",
    "compare": "fastpals.commands.compare",
    "claims": "fastpals.commands.claims",
    "memory": "fastpals.commands.memory_cli",
    "export": "fastpals.commands.export",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"fastpals: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr, end="")
        return 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
