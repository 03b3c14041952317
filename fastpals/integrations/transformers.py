"""Multi-task PAL training with surgery inside the Hugging Face ``transformers.Trainer`` (``docs/api.md``):
the update of ``train.py --batching mixed --surgery NAME``. One process only; ``resume_from_checkpoint`` does
not continue the same run (the Trainer's checkpoints miss the sampler's position and the surgery's state).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import transformers
from torch.utils.data import DataLoader, IterableDataset

from fastpals.data.mixed_batches import MixedBatchSampler, collate_packed, model_inputs
from fastpals.data.per_task_batches import TaskBatcher
from fastpals.data.tokenizer import Tokenizer
from fastpals.model.multitask import TASK_WEIGHTINGS
from fastpals.surgery import TaskGradientBuffer, make_weighting, per_task_gradients, shared_parameters_by_name

__all__ = ["MixedTaskBatches", "MultiTaskTrainer"]


def _as_is(item: Any) -> Any:
    return item


class MixedTaskBatches(IterableDataset):
    """The packed mixed-task micro-batches (:func:`fastpals.data.mixed_batches.collate_packed`'s dicts) of a
    :class:`MixedBatchSampler`, one epoch per ``iter()``; ``len()`` is the micro-batches of an epoch."""

    def __init__(self, batchers: Sequence[TaskBatcher], sampler: MixedBatchSampler) -> None:
        self.batchers, self.sampler = list(batchers), sampler
        self._started = False

    def __len__(self) -> int:
        return self.sampler.micro_batches_per_epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._started and self.sampler.epoch_done():
            self.sampler.start_next_epoch()
        self._started = True
        while not self.sampler.epoch_done():
            yield collate_packed(self.batchers, self.sampler.next_micro_batch())


class MultiTaskTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` training a :class:`fastpals.MultiTaskBert` on mixed-task batches, with
    surgery from one backward. ``train_batchers``: one ``TaskBatcher`` per task, by name or in the model's
    order; ``sampling``: one of :data:`fastpals.data.sampling.SAMPLING_METHODS`; ``surgery``: an aggregator of
    :data:`fastpals.surgery.AGGREGATORS` or ``"none"``; ``weighting``: the loss mix without surgery;
    ``max_tokens``: a token budget per micro-batch instead of ``per_device_train_batch_size`` examples.
    ``args.seed`` seeds the sampler and the surgery; the batchers are the data (no ``train_dataset``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        args: transformers.TrainingArguments,
        train_batchers: Mapping[str, TaskBatcher] | Sequence[TaskBatcher],
        *,
        sampling: str = "annealed",
        surgery: str = "pcgrad",
        surgery_options: Mapping[str, Any] | None = None,
        weighting: str = "examples",
        max_tokens: int | None = None,
        micro_batches_per_epoch: int | None = None,
        **kwargs: Any,
    ) -> None:
        for key in ("train_dataset", "data_collator"):
            if kwargs.get(key) is not None:
                raise ValueError(f"MultiTaskTrainer takes no {key}: the train_batchers are the data")
        names = [spec.name for spec in model.tasks]
        if isinstance(train_batchers, Mapping):
            if set(train_batchers) != set(names):
                raise ValueError(
                    f"train_batchers has tasks {list(train_batchers)}, the model {names}: give one per task"
                )
            batchers = [train_batchers[n] for n in names]
        else:
            batchers = list(train_batchers)
            got = [b.spec.name for b in batchers]
            if got != names:
                raise ValueError(
                    f"train_batchers are for tasks {got}, the model's are {names} (in this order)"
                )
        if weighting not in TASK_WEIGHTINGS:
            raise ValueError(f"weighting={weighting!r}: choose one of {', '.join(TASK_WEIGHTINGS)}")
        self.train_batchers, self.sampling, self.weighting = batchers, sampling, weighting
        self.max_tokens, self.micro_batches_per_epoch, self.surgery = (
            max_tokens,
            micro_batches_per_epoch,
            surgery,
        )
        self.aggregator = self.aggregator_state = None
        if surgery != "none":
            self.aggregator, self.aggregator_state = make_weighting(surgery, **dict(surgery_options or {}))
        self.surgery_buffer: TaskGradientBuffer | None = None
        self.surgery_generator = torch.Generator().manual_seed(args.seed)
        self.last_surgery: Any = None
        super().__init__(model=model, args=args, **kwargs)
        self._sampler(1)  # the sampling options are checked here, not when train() starts
        if self.args.world_size > 1:
            raise ValueError(
                f"MultiTaskTrainer runs on one process (this run has {self.args.world_size}): its surgery buffer "
                "does not all-reduce through accelerate; use fastpals' own trainer (train.py) for data parallel"
            )

    def _sampler(self, num_epochs: int, micro_batches_per_epoch: int | None = None) -> MixedBatchSampler:
        batch_size = None if self.max_tokens else self.args.per_device_train_batch_size
        return MixedBatchSampler.from_batchers(
            self.train_batchers, self.sampling, num_epochs, batch_size=batch_size, max_tokens=self.max_tokens,
            micro_batches_per_epoch=micro_batches_per_epoch or self.micro_batches_per_epoch, seed=self.args.seed,
        )  # fmt: skip

    def get_train_dataloader(self) -> DataLoader:
        """Packed mixed-task micro-batches from fastpals' sampler (:class:`MixedTaskBatches`), one epoch per pass;
        the sampler anneals over the run's epochs (from ``max_steps`` when it is set)."""
        per_epoch = self._sampler(1).micro_batches_per_epoch
        updates = max(1, per_epoch // self.args.gradient_accumulation_steps)
        steps = self.args.max_steps
        epochs = math.ceil(steps / updates) if steps > 0 else math.ceil(self.args.num_train_epochs)
        sampler = self._sampler(max(1, epochs), per_epoch)
        return DataLoader(MixedTaskBatches(self.train_batchers, sampler), batch_size=None, collate_fn=_as_is)

    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Forward, loss and backward of one packed micro-batch (each task's loss is its own mean); with
        surgery the micro-batch that ends the accumulation applies the aggregator, and a non-finite task
        gradient empties every ``.grad``. Returns the loss divided by the accumulation, detached."""
        model.train()
        batch = model_inputs(inputs, self.args.device)
        labels = inputs["labels"].to(self.args.device)
        scale = 1.0 / self.current_gradient_accumulation_steps
        if self.aggregator is None:
            with self.compute_loss_context_manager():
                loss = model.task_losses(model(**batch), labels, weighting=self.weighting).total * scale
            self.accelerator.backward(loss)
            return loss.detach()

        if self.surgery_buffer is None:
            shared, specific = shared_parameters_by_name(model)
            self.surgery_buffer = TaskGradientBuffer(shared, len(model.tasks), task_params=specific)
        buffer = self.surgery_buffer
        with per_task_gradients(model, buffer, batch["layout"]):
            with self.compute_loss_context_manager():
                res = model.task_losses(model(**batch), labels, weighting="equal")
                loss = sum(res.per_task.values()) * scale  # each task's gradient: that of its own mean loss
            self.accelerator.backward(loss)
        if self.accelerator.sync_gradients:  # the accumulation's last micro-batch: surgery before clipping
            self.last_surgery = buffer.apply(self.aggregator, generator=self.surgery_generator)
            if self.last_surgery.skipped:
                model.zero_grad(set_to_none=True)
        return loss.detach()

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The combined loss (``weighting``) of a packed batch, for evaluation loops."""
        out = model(**model_inputs(inputs, self.args.device))
        loss = model.task_losses(out, inputs["labels"].to(self.args.device), weighting=self.weighting).total
        return (loss, out) if return_outputs else loss

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """``MultiTaskBert.save_pretrained(output_dir)``, with the ``processing_class`` when it is a
        :class:`fastpals.Tokenizer`."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        tokenizer = self.processing_class if isinstance(self.processing_class, Tokenizer) else None
        self.accelerator.unwrap_model(self.model).save_pretrained(output_dir, tokenizer=tokenizer)
        torch.save(self.args, f"{output_dir}/training_args.bin")
