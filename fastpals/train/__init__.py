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
"""

from fastpals.train.args import PAL_PRESETS, TrainArgs, build_pal_config
from fastpals.train.command import build_parser, main, parse_args
from fastpals.train.dsconfig import check_ds_config, load_ds_config, resolve_ds_config
from fastpals.train.errors import ConfigError, NonFiniteLossError, TrainingInterrupted
from fastpals.train.loop import Trainer
from fastpals.train.optimizer_setup import lr_lambda, make_optimizer, optimizer_param_groups
from fastpals.train.state import TrainState
from fastpals.train.step import MicroBatch, UpdateResult, run_update

__all__ = [
    "ConfigError",
    "MicroBatch",
    "NonFiniteLossError",
    "PAL_PRESETS",
    "TrainArgs",
    "TrainState",
    "Trainer",
    "TrainingInterrupted",
    "UpdateResult",
    "build_pal_config",
    "build_parser",
    "check_ds_config",
    "load_ds_config",
    "lr_lambda",
    "main",
    "make_optimizer",
    "optimizer_param_groups",
    "parse_args",
    "resolve_ds_config",
    "run_update",
]
