"""The training loop: ``Trainer(args).run()`` sets up data, model and DeepSpeed engine, runs the updates
(:func:`~fastpals.train.step.run_update`), evaluates, checkpoints and writes the outputs of ``--out``."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from tqdm import tqdm

from fastpals.model import evaluate as ev
from fastpals.model.hf_encoder import HFEncoder
from fastpals.model.multitask import MultiTaskBert, count_parameters
from fastpals.surgery import make_weighting, parse_surgery_options
from fastpals.train import outputs
from fastpals.train.args import TrainArgs
from fastpals.train.callbacks import Callback, default_callbacks
from fastpals.train.data_setup import eval_batcher, open_tokenizer, packed_micro_batches, setup_data
from fastpals.train.dsconfig import check_ds_config, initialize, load_ds_config, precision_note
from fastpals.train.errors import (
    ConfigError,
    NonFiniteLossError,
    OutputError,
    SetupCtrlC,
    TrainingInterrupted,
)
from fastpals.train.memory_mode import SURGERY_MEMORY_TEXT, trainer_memory_mode
from fastpals.train.optimizer_setup import build_model, lr_lambda, make_optimizer, optimizer_param_groups
from fastpals.train.state import (
    GeneratorState,
    RNGState,
    TrainState,
    check_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from fastpals.train.step import MicroBatch, Surgery, deepspeed_surgery_buffer, run_update

__all__ = ["Trainer", "timestamped"]


def timestamped(message: str) -> str:
    return f"{datetime.now().strftime('%H:%M:%S')} {message}"


def _rng_state() -> tuple[Any, Any, Any]:
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _set_rng_state(state: tuple[Any, Any, Any]) -> None:
    torch.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


class Trainer:
    """One training run of :class:`TrainArgs`; ``callbacks`` default to :func:`default_callbacks`."""

    def __init__(self, args: TrainArgs, callbacks: list[Callback] | None = None) -> None:
        self.args = args
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.is_main = self.rank == 0
        self.out = Path(args.out)
        requested = load_ds_config(args.ds_config)
        name = f"--ds_config {args.ds_config}"
        self.ds_config = check_ds_config(
            requested, args.batch_size, args.grad_accum, args.surgery, self.world_size, name=name
        )
        self.precision = precision_note(requested, self.ds_config)
        self.ckpt_dir = self.out / "checkpoints"
        # model and tokenizer are checked before --out is touched; a folder in use is refused before them
        if self.is_main:
            outputs.RunLock(self.out).check_free()
        self._tokenizer = open_tokenizer(args)
        # built before --out is touched; set-up restores the random state it left, as if built after the data
        before = _rng_state()
        self._early_model = build_model(args)
        self._rng_after_model = _rng_state()
        _set_rng_state(before)
        self._lock: outputs.RunLock | None = None
        if self.is_main:  # one run per folder: taken before anything in --out is touched
            self._lock = outputs.RunLock(self.out).acquire()
            if self._lock.taken_over is not None:
                pid, host = self._lock.taken_over
                self.log(f"[warning] {self._lock.path}: the run with pid {pid} on host {host} ended without "
                         "releasing its lock (killed?); this run takes the folder over")  # fmt: skip
        try:
            self._replaced = outputs.prepare_out(self.out, args.resume, args.overwrite, self.is_main)
            self._before = outputs.entries(self.out)  # the user's files: never in this run's manifest
            if args.resume:
                check_checkpoint(self.ckpt_dir)  # a broken checkpoint fails here, before the heavy set-up
            self.callbacks = (
                default_callbacks(args, self.out, self.is_main) if callbacks is None else callbacks
            )
        except BaseException:
            self._release_lock()
            raise
        self.loss_hooks: list[Callable[[int, torch.Tensor], torch.Tensor]] = []  # test faults only
        self.state = TrainState(
            step_losses={t: ([], []) for t in args.task_list}, options=args.resume_options()
        )
        self.finished = False
        self.phase = "set-up"  # then "training", then "writing the outputs" (named when Ctrl-C stops the run)
        self._stop_signal: int | None = None
        self._checkpoint: tuple[Path, int] | None = None  # the last checkpoint (all finite) and its step
        self._finite_step: int | None = None  # the update step whose weights were last checked finite

    def log(self, message: str) -> None:
        """A timestamped line on stderr (main rank), above the progress bar."""
        if self.is_main:
            tqdm.write(timestamped(message), file=sys.stderr)

    def record(self, entry: dict[str, Any]) -> None:
        """Hand one record (``metrics.jsonl`` line) to the callbacks."""
        for callback in self.callbacks:
            callback.on_record(self, entry)

    def _log_setup(self) -> None:
        """The set-up lines: model, encoder, precision and device."""
        args, bert, counts = self.args, self.model.bert, count_parameters(self.model)
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        pals = "no PALs" if args.pal_config is None else f"PALs {args.pal}"
        self.log(
            f"[model] {args.model} + {pals}, tasks {','.join(args.task_list)}: {counts['total'] / 1e6:.1f}M "
            f"parameters, {trained / 1e6:.1f}M trained"
        )
        if isinstance(bert, HFEncoder):
            how = "padded per micro-batch (its attention takes no packed input)"
            encoder = f"HF {bert.model_type} (transformers AutoModel + inject_pals)"
        else:
            how, encoder = "packed without padding", "fastpals minBERT (fused PALs)"
        self.log(
            f"[model] encoder: {encoder}; batches {how if args.batching == 'mixed' else 'padded per task'}"
        )
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"device cpu ({torch.get_num_threads()} threads)"
        if torch.cuda.is_available():
            device = f"device cuda:{local} ({torch.cuda.get_device_name(local)})"
        # after the checks of data and model, whose errors are one line
        self.log(f"[setup] {self.precision}; {device}")

    def _setup_data(self) -> None:
        data = setup_data(self.args, self.rank, self.world_size, self.log, tokenizer=self._tokenizer)
        self.tokenizer, self.pair_encoding, self.sampler = data.tokenizer, data.pair_encoding, data.sampler
        self.train_batchers, self.dev_batchers = data.train_batchers, data.dev_batchers
        self.train_sizes, self.total_updates = data.train_sizes, data.total_updates
        self._exact_logged = False

    def _setup_model(self) -> None:
        self.model, self._early_model = self._early_model, None  # built in __init__: its random state now
        _set_rng_state(self._rng_after_model)
        # as build_model's torch.manual_seed did (lazy: no CUDA init)
        torch.cuda.manual_seed_all(self.args.seed)

    def _setup_engine(self) -> None:
        args, lr = self.args, self.args.lr
        groups = optimizer_param_groups(
            self.model, lr, args.pal_lr or lr, args.head_lr or lr, args.weight_decay
        )
        optimizer = make_optimizer(groups, args.optimizer)
        total, warmup = self.total_updates, args.warmup

        def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, total, warmup))

        self.engine, self.optimizer, _, self.scheduler = initialize(
            self.model, optimizer, scheduler, self.ds_config, log=self.log, verbose=self.args.verbose
        )
        self.device = self.engine.device
        self.zero_stage = self.engine.zero_optimization_stage()
        self.components: dict[str, Any] = {"sampler": self.sampler, "rng": RNGState(),
                                           **{f"batcher/{t}": b for t, b in self.train_batchers.items()}}  # fmt: skip
        self.surgery_buffer = None
        if args.surgery != "none":
            self._setup_surgery()

    def _setup_surgery(self) -> None:
        args, module, stage = self.args, self.engine.module, self.zero_stage
        self.surgery_memory, dtype, choice = trainer_memory_mode(self)
        keep = choice.keep_bytes if choice is not None else 0
        # the gradients of one backward bypass DeepSpeed's reduce: the rows are all-reduced
        reduce = args.batching == "mixed" and self.world_size > 1
        self.surgery_buffer = deepspeed_surgery_buffer(
            module, len(args.task_list), stage, dtype, reduce, self.surgery_memory, keep
        )
        why = f" (auto: {choice.why})" if choice is not None else ""
        self.log(f"[setup] surgery {args.surgery}: {SURGERY_MEMORY_TEXT[self.surgery_memory]}{why}")
        self.aggregator, aggregator_state = make_weighting(
            args.surgery, **parse_surgery_options(args.surgery_opts)
        )
        if aggregator_state is not None:  # Nash-MTL, GradVac: their state is checkpointed
            self.components["aggregator_state"] = aggregator_state
        self.surgery_generator = torch.Generator().manual_seed(args.seed)
        self.components["surgery_rng"] = GeneratorState(self.surgery_generator)

    def output_sizes(self) -> tuple[int, int]:
        """Estimated bytes of a checkpoint (weights, fp32 master weights, optimizer states) and of best/."""
        params = list(self.engine.module.parameters())
        module = sum(p.numel() * p.element_size() for p in params)
        trained = sum(p.numel() for p in params if p.requires_grad)
        states = {"adamw": 2, "sgd": 1, "rmsprop": 1}.get(self.args.optimizer, 2)
        master = 1 if params and params[0].dtype != torch.float32 else 0
        return module + 4 * trained * (states + master), 4 * sum(p.numel() for p in params)

    def save_checkpoint(self) -> Path:
        """DeepSpeed checkpoint + train state + component states (once per step, finite weights only); the first
        one of an ``--overwrite`` run also deletes the earlier run it replaced."""
        step = self.state.global_step
        if self._checkpoint is not None and self._checkpoint[1] == step:
            return self._checkpoint[0]
        self.check_finite()
        path = save_checkpoint(self.engine, self.ckpt_dir, self.state, self.components, self.is_main)
        self._checkpoint = (path, step)
        self._record_manifest()
        self._settle_replaced(failed=False)
        return path

    def check_finite(self) -> None:
        """Before an evaluation, a best/ save or a checkpoint, once per update: :class:`NonFiniteLossError`
        (after a ``"nonfinite"`` record) unless every weight is finite."""
        step = self.state.global_step
        if self._finite_step == step:
            return
        flags = [torch.isfinite(p).all() for p in self.engine.module.parameters()]
        if flags and not bool(torch.stack(flags).all()):  # one host read
            self.record({"type": "nonfinite", "step": step, "task": "all", "what": "weights"})
            raise NonFiniteLossError(step, "all", math.nan, "weights")
        self._finite_step = step

    def _settle_replaced(self, failed: bool) -> None:
        """Delete the run ``--overwrite`` moved aside, or put it back (quietly) when this run ``failed``."""
        aside, self._replaced = getattr(self, "_replaced", None), None
        if failed:  # quietly: the error that stopped the run stays the one line the user sees
            outputs.restore_replaced(self.out, aside)
        else:
            outputs.discard_replaced(aside)

    def load_checkpoint(self) -> None:
        path, state = load_checkpoint(self.engine, self.ckpt_dir, self.components)
        now = self.args.resume_options()
        differ = [k for k in now if state.options.get(k) != now[k]]
        if differ:
            detail = ", ".join(f"--{k.replace('_', '-')} (saved {state.options.get(k)!r}, now {now[k]!r})"
                               for k in differ)  # fmt: skip
            raise ConfigError(f"--resume: {path} was saved with other options: {detail}")
        self.state = state
        self._checkpoint = (path, state.global_step)
        self.log(f"[resume] {path}: update step {state.global_step}, epoch {self.sampler.epoch}")
        if self.is_main:  # records of the updates after the checkpoint are re-run: dropped, not kept twice
            dropped = outputs.trim_metrics(self.out / "metrics.jsonl", state.global_step)
            self.record({"type": "resume", "step": state.global_step, "checkpoint": str(path),
                         "dropped_records": dropped})  # fmt: skip

    def evaluate(self) -> tuple[dict[str, float], dict[str, Any]]:
        """Dev metrics and predictions of the current model; NaN/inf outputs stop the run
        (:class:`NonFiniteLossError`, after a ``"nonfinite"`` record)."""
        t0 = time.perf_counter()
        model = ev.eval_model(self.engine.module, self.device)
        try:
            result = ev.evaluate(model, self.dev_batchers, self.args.task_list, self._progress())
        except ev.NonFiniteOutputs as err:  # finite weights, NaN/inf logits: never scored nor saved as best/
            step = self.state.global_step
            self.record({"type": "nonfinite", "step": step, "task": err.task, "what": "outputs"})
            raise NonFiniteLossError(step, err.task, math.nan, "outputs") from None
        self.state.add_time("eval_s", time.perf_counter() - t0)
        return result

    def _progress(self) -> bool:
        return self.is_main and not self.args.no_progress

    def _eval_and_track(self, epoch: int) -> dict[str, float]:
        self.check_finite()  # a non-finite model is never evaluated nor saved as best/
        dev, preds = self.evaluate()
        state = self.state
        entry = {"type": "eval", "step": state.global_step, "epoch": epoch, "dev": dev}
        state.evals.append(entry)
        self.record(entry)
        self.log(
            f"[eval] step {state.global_step} epoch {epoch}: "
            + ", ".join(f"{k} {v:.4f}" for k, v in dev.items())
        )
        if dev["overall"] > state.best["overall"]:
            state.best = {"overall": dev["overall"], "step": state.global_step, "epoch": epoch, "dev": dev}
            if self.is_main:
                outputs.save_best(self.engine.module, self.tokenizer, self.out / "best", self.args.max_length,
                                  state.global_step, self.args.task_list)  # fmt: skip
                try:
                    outputs.write_dev_predictions(self.out / "predictions", preds, self.args.task_specs)
                except OSError as err:
                    raise OutputError(
                        f"cannot write the dev predictions, {err.filename or self.out / 'predictions'}: "
                        f"{err.strerror}: free space or fix the permissions, then --resume"
                    ) from err
        return dev

    def _task_micro_batch(self, task_index: int) -> MicroBatch:
        """The next batch of task ``task_index`` (its batcher's), on the device."""
        batch = self.train_batchers[self.args.task_list[task_index]].next_batch()
        return MicroBatch(
            inputs=ev.padded_model_inputs(batch, task_index, self.device), labels=batch["labels"].to(self.device).float(),
            tasks=(task_index,), examples=(batch["input_ids"].shape[0],),
        )  # fmt: skip

    def train_update(self, group: list[Any]) -> dict[str, Any]:
        """One :func:`~fastpals.train.step.run_update` over ``group`` (task indices or mixed selections): each
        task's ``loss``, the ``examples`` (mixed: also ``task_examples``, ``task_tokens``, ``tokens``)."""
        mixed = self.args.batching == "mixed"
        if mixed:
            micro: Iterable[MicroBatch] = packed_micro_batches(
                list(self.train_batchers.values()), group, self.device, self.args.task_weighting
            )
        else:
            micro = (self._task_micro_batch(t) for t in group)
        surgery, strategy = None, "none"
        if self.surgery_buffer is not None:
            surgery = Surgery(self.surgery_buffer, self.aggregator, self.surgery_generator)
            strategy = "one_backward" if mixed else "per_task_backward"
        update = run_update(self.engine, micro, strategy, surgery=surgery, step=self.state.global_step + 1,
                            loss_hooks=self.loss_hooks, record=self.record)  # fmt: skip
        skipped = update.surgery is not None and update.surgery.skipped
        if skipped and not update.overflow:  # an fp16 overflow: the loss scaler skipped the step itself
            bad = [self.args.task_list[i] for i in update.surgery.nonfinite_tasks] or ["task-specific"]
            step = self.state.global_step + 1
            self.record({"type": "nonfinite", "step": step, "task": bad, "what": "gradient"})
            raise NonFiniteLossError(step, ",".join(bad), math.nan, "task gradient")
        if surgery is not None and surgery.exact_names is not None and not self._exact_logged:
            self._exact_logged = True
            if surgery.exact_names:
                self.log(
                    f"[surgery] one backward gives every task's gradient except for {len(surgery.exact_names)} "
                    f"shared parameters, which take the exact per-task path: {', '.join(surgery.exact_names)}"
                )
            else:
                self.log("[surgery] one backward gives every task's gradient of every shared parameter")
        self.state.global_step += 1
        stats: dict[str, Any] = {"loss": update.loss, "examples": sum(update.examples.values())}
        if mixed:
            stats.update(
                task_examples=update.examples, task_tokens=update.tokens, tokens=sum(update.tokens.values())
            )
        return stats

    def run(self) -> dict[str, Any]:
        """Set up, train, evaluate and write the outputs; returns the results dict."""
        try:
            try:
                results = self._run()
            except BaseException as err:
                if isinstance(err, NonFiniteLossError):  # name the run's good checkpoint and best model
                    best, best_step = self.out / "best", self.state.best.get("step")
                    best = best if best_step is not None and best.is_dir() else None
                    err.add_context(*(self._checkpoint or (None, None)), best, best_step)
                self._record_manifest()
                self._settle_replaced(failed=True)
                raise
            self._record_manifest()
            self._settle_replaced(failed=False)
        finally:
            self._release_lock()
        return results

    def _record_manifest(self) -> None:
        """The run's manifest in --out (main rank), quiet on an OSError (the run's error stays the line)."""
        if self.is_main and getattr(self, "_before", None) is not None:
            with contextlib.suppress(OSError):
                outputs.record_manifest(self.out, self._before)

    def _release_lock(self) -> None:
        lock, self._lock = getattr(self, "_lock", None), None
        if lock is not None:
            lock.release()

    def _run(self) -> dict[str, Any]:
        args, start = self.args, time.perf_counter()
        self._setup_data()
        self._setup_model()
        self._log_setup()
        self._setup_engine()
        if self.is_main:  # before training: room for a checkpoint and best/
            problem = outputs.free_space_error(self.out, *self.output_sizes(), resume=args.resume)
            if problem is not None:
                raise problem
        if args.resume:
            self.load_checkpoint()
        elif self.is_main:
            outputs.atomic_write_text(self.out / "train_args.json", json.dumps(args.options(), indent=2))
            self.record({"type": "config", "args": args.options(), "ds_config": self.ds_config,
                         "parameters": count_parameters(self.model)})  # fmt: skip
        self.state.add_time("setup_s", time.perf_counter() - start)
        self.state.timings["process_setup_s"] = startup = time.time() - psutil.Process().create_time()
        self.log(f"[setup] ready {startup:.1f} s after the process started (imports, data, model, engine)")
        stops = [signal.SIGTERM, signal.SIGINT] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
        # a closed terminal (SIGHUP) stops as SIGTERM
        old = {s: signal.signal(s, self._on_signal) for s in stops}
        try:
            if isinstance(old[signal.SIGINT], SetupCtrlC):
                old[signal.SIGINT].check()  # a Ctrl-C of the set-up that Python swallowed
            if args.eval_at_start and self.state.untrained is None:
                dev = self.state.untrained = self.evaluate()[0]
                self.record({"type": "eval", "step": 0, "epoch": 0, "dev": dev, "untrained": True})
                self.log("[eval] untrained (step 0): " + ", ".join(f"{k} {v:.4f}" for k, v in dev.items()))
            for callback in self.callbacks:
                callback.on_train_start(self)
            self.phase = "training"
            self._loop()
            self.finished = True
            self.phase = "writing the outputs"
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            for callback in self.callbacks:
                callback.on_train_end(self)
        return self._finish(start)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """SIGTERM/SIGHUP/SIGINT: stop after this update (or evaluation) with a checkpoint; a second Ctrl-C stops at
        once, without one (:class:`TrainingInterrupted`)."""
        if self._stop_signal is not None and signum == signal.SIGINT:
            ckpt = self._checkpoint[0] if self._checkpoint is not None else None
            raise TrainingInterrupted(signum, self.state.global_step, ckpt, at_once=True)
        self._stop_signal = signum
        if signum == signal.SIGINT and self.is_main:
            print(f"{timestamped('[stop]')} Ctrl-C: stopping after this update/evaluation, with a checkpoint; "
                  "Ctrl-C again to stop now (without one)", file=sys.stderr, flush=True)  # fmt: skip

    def _stop_if_asked(self, t_train: float) -> None:
        """After an update (and its evaluation, checkpoint): a stop signal writes a checkpoint and stops."""
        if self._stop_signal is None:
            return
        self.state.add_time("train_s", time.perf_counter() - t_train)
        path = self.save_checkpoint()
        self.record({"type": "interrupted", "step": self.state.global_step, "signal": self._stop_signal})
        raise TrainingInterrupted(self._stop_signal, self.state.global_step, path)

    def _loop(self) -> None:
        args, sampler, state = self.args, self.sampler, self.state
        self.engine.train()
        t_train = time.perf_counter()
        while True:
            if sampler.epoch_done():
                if state.evaluated_epoch < sampler.epoch:
                    dev = self._eval_and_track(sampler.epoch)
                    state.evaluated_epoch = sampler.epoch
                    self.record(
                        {"type": "epoch", "epoch": sampler.epoch, "step": state.global_step, "dev": dev}
                    )
                    self.save_checkpoint()
                    self._stop_if_asked(t_train)
                if sampler.epoch == args.epochs:
                    break
                sampler.start_next_epoch()
            while not sampler.epoch_done():
                group = sampler.next_update()
                t0 = time.perf_counter()
                stats = self.train_update(group)
                dt = time.perf_counter() - t0
                entry = {"type": "step", "step": state.global_step, "epoch": sampler.epoch, "loss": stats["loss"],
                         "lr": self.scheduler.get_last_lr(), "examples_per_s": stats["examples"] / dt, "seconds": dt,
                         **{k: stats[k] for k in ("task_examples", "task_tokens", "tokens") if k in stats}}  # fmt: skip
                if "tokens" in stats:
                    entry["tokens_per_s"] = stats["tokens"] / dt
                for t, v in stats["loss"].items():
                    state.step_losses[t][0].append(state.global_step)
                    state.step_losses[t][1].append(v)
                self.record(entry)
                inside = not sampler.epoch_done()  # the epoch's end evaluates and checkpoints anyway
                if args.eval_every and state.global_step % args.eval_every == 0 and inside:
                    self._eval_and_track(sampler.epoch)
                if args.checkpoint_every and state.global_step % args.checkpoint_every == 0 and inside:
                    state.add_time("train_s", time.perf_counter() - t_train)
                    t_train = time.perf_counter()
                    self.save_checkpoint()
                self._stop_if_asked(t_train)
        state.add_time("train_s", time.perf_counter() - t_train)

    def _finish(self, start: float) -> dict[str, Any]:
        args, state = self.args, self.state
        results: dict[str, Any] = {
            "dev": state.best["dev"], "best_step": state.best["step"], "best_epoch": state.best["epoch"],
            "untrained_dev": state.untrained, "evals": state.evals, "steps": state.global_step,
            "quora_note": "para dev = the held-out 10% (sha256 of id) split of quora-dev.csv; trained on the rest",
            "config": args.options(), "pal_config": None if args.pal_config is None else args.pal_config.to_dict(),
            "ds_config": self.ds_config, "zero_stage": self.zero_stage,
        }  # fmt: skip
        if self.is_main:
            t0 = time.perf_counter()
            self._predict_test()
            state.timings["outputs_s"] = time.perf_counter() - t0
            state.timings["total_s_this_process"] = time.perf_counter() - start
            results["timings"] = state.timings
            outputs.atomic_write_text(self.out / "results.json", outputs.strict_json(results, indent=2))
            print(outputs.results_table(results), flush=True)
        return results

    def _predict_test(self) -> None:
        # the best weights (saved in fp32), evaluated in the training dtype where the device runs it natively
        dtype = next(self.engine.module.parameters()).dtype
        best = ev.eval_model(MultiTaskBert.load(self.out / "best").to(self.device), self.device, dtype)
        for i, t in enumerate(self.args.task_list):
            if "test" not in self.args.task_specs[t].files:
                continue
            batcher = eval_batcher(self.args, self.tokenizer, self.pair_encoding, t, "test", self.args.max_predict,
                                   self.log)  # fmt: skip
            ids, p, _ = ev.predict_batches(best, batcher, i, self._progress(), desc=f"test {t}")
            outputs.write_test_predictions(self.out / "predictions", self.args.task_specs[t], ids, p)
