"""Multi-task fine-tuning with DeepSpeed, as a library: ``train.py`` is :func:`main`.

* :class:`TrainArgs` (:mod:`.args`, fields declared with :mod:`.options`): every option, checked;
  :func:`parse_args`/:func:`build_parser` (:mod:`.command`) make it from a command line.
* :class:`Trainer` (:mod:`.loop`): set-up, updates, checkpoints; :class:`TrainState` (:mod:`.state`).
* :mod:`.data_setup`: the run's tokenizer, task batchers and sampler.
* :mod:`fastpals.model.evaluate`: prediction and dev metrics, shared with ``fastpals predict``.
* :mod:`.callbacks`: JSONL, TensorBoard, progress, plots (:mod:`.plots`), test-only faults.
* :func:`run_update` (:mod:`.step`): one optimizer update of either batching, with or without gradient surgery,
  also timed by the benchmarks.
* :mod:`.dsconfig`, :mod:`.optimizer_setup`, :mod:`.distributed`, :mod:`.outputs`.
* :mod:`.memory_states` (DeepSpeed's model states per rank, the live-tensor tracker) and :mod:`.memory_mode`
  (what ``--surgery-memory auto`` picks), shared with ``fastpals memory``.

Imports are lazy, so ``fastpals.train.step`` or ``.dsconfig`` load without DeepSpeed or the data code.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "TrainArgs": "args", "PAL_PRESETS": "args", "build_pal_config": "args",
    "build_parser": "command", "main": "command", "parse_args": "command",
    "ConfigError": "errors", "NonFiniteLossError": "errors", "TrainingInterrupted": "errors",
    "Trainer": "loop", "TrainState": "state", "run_update": "step", "MicroBatch": "step", "UpdateResult": "step",
    "check_ds_config": "dsconfig", "load_ds_config": "dsconfig", "resolve_ds_config": "dsconfig",
    "lr_lambda": "optimizer_setup", "optimizer_param_groups": "optimizer_setup", "make_optimizer": "optimizer_setup",
}  # fmt: skip

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f"fastpals.train.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'fastpals.train' has no attribute {name!r}")
