"""Multi-task fine-tuning with DeepSpeed, as a library: ``train.py`` is :func:`main`, :class:`TrainArgs` every
option, :class:`Trainer` the loop and :func:`run_update` one optimizer update."""

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
