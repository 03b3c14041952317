"""The findings ``fastpals claims`` tests (:data:`FINDINGS`), the arms they compare (:data:`ARMS`), the budgets,
the statistics (paired t-intervals, verdicts) and each run's ``train.py`` options."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

__all__ = [
    "ARMS",
    "FINDINGS",
    "REFERENCE_ARMS",
    "Arm",
    "Budget",
    "Comparison",
    "Finding",
    "paired_interval",
    "plan_runs",
    "resolve_budget",
    "run_argv",
    "student_t_quantile",
    "verdict",
]

#: options every run gets before the caller's common options (the short-budget learning rates of `fastpals compare`'s
#: committed table, docs/results/compare_minilm_cpu.md)
DEFAULT_COMMON = tuple("--batch-size 16 --lr 1e-4 --pal-lr 5e-4 --head-lr 2e-4 --max-eval 600".split())
#: options every run of the converged budget gets first: the main job's settings (the Makefile's ``train`` target)
CONVERGED_COMMON = tuple(
    "--batch-size 48 --lr 1.2e-4 --pal-lr 6e-4 --head-lr 2.4e-4 --warmup 0.06 --max-length 128 --max-eval 600".split()
)


@dataclass(frozen=True)
class Budget:
    """How long every run trains: ``updates`` updates after the options ``defaults``, ``evals`` evenly spaced
    dev evaluations; ``examples_equivalent``: an update of one micro-batch per task counts as ``tasks``."""

    name: str
    updates: int
    defaults: tuple[str, ...] = DEFAULT_COMMON
    evals: int = 1
    examples_equivalent: bool = False
    what: str = ""

    def arm_updates(self, micro_batches_per_update: int) -> int:
        """The updates of an arm whose update holds ``micro_batches_per_update`` micro-batches."""
        return (
            max(1, round(self.updates / micro_batches_per_update))
            if self.examples_equivalent
            else self.updates
        )

    def eval_every(self, updates: int) -> int | None:
        """``--eval-every`` of a run of ``updates`` updates (None: evaluated at its end only)."""
        return math.ceil(updates / self.evals) if self.evals > 1 else None


EARLY = Budget("early-training", 100, what="100 updates of 16 examples, each run scored at its end: how fast each "
               "arm starts, not what it reaches")  # fmt: skip
CONVERGED = Budget("converged", 867, CONVERGED_COMMON, evals=5, examples_equivalent=True,
                   what="the main job's budget (`make train`): 867 updates of 48 examples, an arm with one "
                   "micro-batch per task per update (gradient surgery) the same examples in fewer updates; "
                   "dev every 1/5 of the run")  # fmt: skip
QUICK = Budget("quick", 4, evals=2, what="the pipeline check: 4 updates, dev after 2 and 4")


@dataclass(frozen=True)
class Arm:
    """One system of a comparison: ``train.py`` ``options``; ``cost``: its run time relative to the baseline's
    (docs/results/compare_minilm_cpu.md), which orders the runs and weighs the ETA."""

    name: str
    label: str
    options: tuple[str, ...]
    cost: float = 1.0


@dataclass(frozen=True)
class Comparison:
    """The claim that arm ``better`` scores higher than arm ``worse`` on the finding's metric."""

    better: str
    worse: str


@dataclass(frozen=True)
class Finding:
    """One finding of one report: ``metric`` is ``overall`` (SST, Quora, STS), a task name or ``best_step`` (the
    update of a run's best dev overall, from its ``results.json``)."""

    key: str
    report: str
    claim: str
    metric: str
    comparisons: tuple[Comparison, ...]
    note: str = ""
    arms: tuple[str, ...] = ()
    #: the claim is that ``better`` has the LOWER value (``best_step``: it peaks earlier)
    lower: bool = False

    def arm_names(self) -> tuple[str, ...]:
        """The arms in the order of first mention (``arms`` when given, then the comparisons')."""
        names = list(self.arms)
        for c in self.comparisons:
            names += [c.better, c.worse]
        return tuple(dict.fromkeys(names))


_BASE = ("--recipe", "baseline_multitask")
#: the learning-curve arms' evaluation: dev every 20 updates (and at the end), so a run's best update is known
_CURVE = ("--eval-every", "20")
ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        Arm("base", "multi-task baseline (no PALs, annealed, AdamW)", _BASE),
        Arm("pal12", "baseline + PAL (12 heads)", (*_BASE, "--pal", "12heads"), 1.3),
        Arm("pcgrad", "baseline + PCGrad", (*_BASE, "--surgery", "pcgrad"), 4.0),
        Arm("pal12_pcgrad", "baseline + PAL (12 heads) + PCGrad", (*_BASE, "--pal", "12heads", "--surgery", "pcgrad"),
            10.0),
        Arm("round_robin", "baseline, round-robin sampling", (*_BASE, "--sampling", "round_robin")),
        Arm("proportional", "baseline, proportional sampling", (*_BASE, "--sampling", "proportional")),
        Arm("uniform", "baseline, uniform sampling", (*_BASE, "--sampling", "uniform")),
        Arm("rmsprop", "baseline with RMSProp", (*_BASE, "--optimizer", "rmsprop")),
        Arm("sgd", "baseline with SGD (momentum 0.9)", (*_BASE, "--optimizer", "sgd")),
        Arm("adamw_curve", "baseline (AdamW), dev every 20 updates", (*_BASE, *_CURVE), 1.2),
        Arm("rmsprop_curve", "baseline with RMSProp, dev every 20 updates", (*_BASE, "--optimizer", "rmsprop", *_CURVE),
            1.2),
        Arm("sgd_curve", "baseline with SGD (momentum 0.9), dev every 20 updates",
            (*_BASE, "--optimizer", "sgd", *_CURVE), 1.2),
        Arm("cos_base", "baseline, siamese pairs (STS cosine)", (*_BASE, "--pair-mode", "sbert_cosine")),
        Arm("pal_pcgrad_cos", "001: PAL + PCGrad, siamese pairs (STS cosine)", ("--recipe", "001_pal_pcgrad_cosine"),
            5.0),
        Arm("gem_joint", "002 without PALs and GEM: jointly fine-tuned BERT",
            ("--recipe", "002_pal12_gem", "--pal", "none", "--surgery", "none"), 2.2),
        Arm("gem_pal", "002: PALs (12 heads) without GEM", ("--recipe", "002_pal12_gem", "--surgery", "none"), 2.5),
        Arm("gem_pal_gem", "002: PALs (12 heads) with GEM", ("--recipe", "002_pal12_gem"), 2.8),
        Arm("shared4", "003: all-shared baseline (no PALs), 4 tasks", ("--recipe", "003_pal_top", "--pal", "none"),
            1.1),
        Arm("embert", "003: EmBERT (every layer)", ("--recipe", "003_embert"), 1.1),
        Arm("pal_gate", "003: gated PALs (every layer)", ("--recipe", "003_pal_gate"), 1.4),
        Arm("pal_top", "003: PALs at the top", ("--recipe", "003_pal_top"), 1.4),
        Arm("pal_top_parallel", "003: PALs top + parallel", ("--recipe", "003_pal_top_parallel"), 1.6),
        Arm("pal_half", "004: half PALs (top 3 of MiniLM's 6 layers, d_s 276)",
            ("--recipe", "004_pal_half", "--pal-layers", "3"), 1.2),
        Arm("pal_full", "004: full PALs (every layer, d_s 204)", ("--recipe", "004_pal_full"), 1.3),
        Arm("single_sst", "single-task SST", ("--recipe", "single_sst"), 0.85),
        Arm("single_para", "single-task Quora", ("--recipe", "single_para"), 0.85),
        Arm("single_sts", "single-task STS", ("--recipe", "single_sts"), 0.85),
    )
}  # fmt: skip
REFERENCE_ARMS = ("single_sst", "single_para", "single_sts")

C = Comparison
FINDINGS: tuple[Finding, ...] = (
    Finding("000-pal", "000", "PAL adds about +1% over the multi-task baseline", "overall", (C("pal12", "base"),)),
    Finding("000-surgery", "000", "gradient surgery (PCGrad) adds about +1% over the multi-task baseline", "overall",
            (C("pcgrad", "base"),)),
    Finding("000-pal+surgery", "000", "PAL + surgery together is worse than either alone", "overall",
            (C("pal12", "pal12_pcgrad"), C("pcgrad", "pal12_pcgrad"))),
    Finding("000-sampling", "000", "annealed sampling beats round-robin, proportional and uniform", "overall",
            (C("base", "round_robin"), C("base", "proportional"), C("base", "uniform"))),
    Finding("000-optimizer", "000", "RMSProp ends higher than AdamW and SGD (same learning rate)", "overall",
            (C("rmsprop", "base"), C("rmsprop", "sgd")),
            "each run scored once, at its end; the peaks: 000-optimizer-peak and 000-optimizer-earlier"),
    Finding("000-optimizer-peak", "000", "RMSProp peaks higher than AdamW and SGD (same learning rate)", "overall",
            (C("rmsprop_curve", "adamw_curve"), C("rmsprop_curve", "sgd_curve")),
            "each run's best dev overall of its evaluations every 20 updates and at its end"),
    Finding("000-optimizer-earlier", "000", "RMSProp peaks earlier than AdamW and SGD", "best_step",
            (C("rmsprop_curve", "adamw_curve"), C("rmsprop_curve", "sgd_curve")),
            "each run is evaluated every 20 updates and at its end (ties: the first); earlier is better", lower=True),
    Finding("001", "001", "PAL with PCGrad improves the overall score over the multi-task baseline", "overall",
            (C("pal_pcgrad_cos", "cos_base"),),
            "both arms score STS by the cosine of siamese embeddings (the report's setting)"),
    Finding("002", "002", "PALs without GEM beat jointly fine-tuned BERT; PALs with GEM are worse than without",
            "overall", (C("gem_pal", "gem_joint"), C("gem_pal", "gem_pal_gem")),
            "GEM here constrains each update with the current batches' task gradients, not an episodic memory"),
    Finding("003", "003", "of single methods only PALs at the top beat the all-shared baseline; top + parallel is "
            "best; methods inside every layer do worse than the stand-alone top layers", "overall",
            (C("pal_top", "shared4"), C("shared4", "embert"), C("shared4", "pal_gate"),
             C("pal_top_parallel", "pal_top"), C("pal_top", "embert"), C("pal_top", "pal_gate")),
            "trained on 4 tasks (with CFIMDB) as in the report; the metric is overall over SST, Quora and STS"),
    Finding("004-overall", "004", "zero PALs beat half and full PALs overall", "overall",
            (C("base", "pal_half"), C("base", "pal_full")),
            "zero PALs = the multi-task baseline (identical options); 'half' = the top 3 of MiniLM's 6 layers"),
    Finding("004-para", "004", "PALs raise paraphrase (Quora) accuracy", "para",
            (C("pal_half", "base"), C("pal_full", "base"))),
)  # fmt: skip
del C
#: ``--quick``: two findings that share their arms (the CI check of the whole pipeline)
QUICK_FINDINGS = ("004-overall", "004-para")
QUICK_ARMS = ("base", "pal_full")


def quick_finding(finding: Finding) -> Finding:
    """``finding`` with only its comparisons between :data:`QUICK_ARMS` (``--quick``)."""
    comps = tuple(c for c in finding.comparisons if c.better in QUICK_ARMS and c.worse in QUICK_ARMS)
    return replace(finding, comparisons=comps, arms=())


# ----------------------------------------------------------------------------------------------------- statistics
def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; NaN for one value) of ``values``."""
    n = len(values)
    mean = sum(values) / n if n else math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
    return mean, sd


def paired_interval(better: Sequence[float], worse: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """The paired differences ``better[i] - worse[i]``: ``{"n", "mean", "sd", "lo", "hi"}``, ``lo``/``hi``
    the two-sided ``level`` Student-t interval ``mean ± t_{(1+level)/2, n-1} sd / sqrt(n)`` (NaN: n < 2)."""
    if len(better) != len(worse):
        raise ValueError(f"paired values need the same seeds: {len(better)} vs {len(worse)}")
    diffs = [b - w for b, w in zip(better, worse)]
    n = len(diffs)
    mean, sd = mean_sd(diffs)
    half = student_t_quantile((1.0 + level) / 2.0, n - 1) * sd / math.sqrt(n) if n >= 2 else math.nan
    return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half}


def student_t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (``0.5 <= p < 1``) of Student's t with ``df`` degrees of freedom: bisection on the CDF,
    whose integral over ``[0, x]`` is Simpson's rule in ``u = atan(x)`` (a smooth integrand on a finite range)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def mass(x: float, steps: int = 2000) -> float:  # P(0 < T < x)
        top = math.atan(x)
        h = top / steps

        def f(u: float) -> float:  # the density at tan(u), times dx/du
            return math.exp(log_c - (df + 1) / 2 * math.log1p(math.tan(u) ** 2 / df)) / math.cos(u) ** 2

        inner = sum((4 if i % 2 else 2) * f(i * h) for i in range(1, steps))
        return h / 3 * (f(0.0) + inner + f(top))

    lo, hi = 0.0, 1.0
    while mass(hi) < p - 0.5:
        lo, hi = hi, 2 * hi
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mass(mid) < p - 0.5 else (lo, mid)
    return 0.5 * (lo + hi)


def verdict(interval: dict[str, float]) -> str:
    """``holds`` (the interval lies above 0), ``reversed`` (below 0) or ``not resolved`` (holds 0, n < 2)."""
    return "holds" if interval["lo"] > 0 else "reversed" if interval["hi"] < 0 else "not resolved"


# ------------------------------------------------------------------------------------------------------- the runs
def run_argv(
    arm: Arm,
    seed: int,
    updates: int,
    common: Sequence[str],
    run_dir: Path,
    defaults: Sequence[str] = DEFAULT_COMMON,
    eval_every: int | None = None,
) -> list[str]:
    """The ``train.py`` options of one run: the arm's options, the budget's ``defaults``, the common ones, then
    the updates, the evaluation interval (when the budget evaluates during the run), seed and folder."""
    every = ["--eval-every", str(eval_every)] if eval_every else []
    return [*arm.options, *defaults, *common, "--epochs", "1", "--steps-per-epoch", str(updates), *every,
            "--seed", str(seed), "--out", str(run_dir), "--overwrite", "--no-progress", "--max-predict", "8"]  # fmt: skip


def plan_runs(findings: Sequence[Finding], reference: bool) -> list[str]:
    """The arms to run, cheapest finding first (so that a stopped run leaves whole findings), then the reference."""
    cheapest_first = sorted(findings, key=lambda f: sum(ARMS[a].cost for a in f.arm_names()))
    arms = [a for f in cheapest_first for a in f.arm_names()] + list(REFERENCE_ARMS if reference else ())
    return list(dict.fromkeys(arms))


def resolve_budget(text: str | None, quick: bool = False) -> Budget:
    """``--budget``: ``early``, ``converged``, a number of updates, or None (``--quick``: :data:`QUICK`; on a GPU
    :data:`CONVERGED`; else :data:`EARLY`). Raises ValueError (one line) for anything else."""
    if text is None:
        return QUICK if quick else CONVERGED if torch.cuda.is_available() else EARLY
    if text in ("early", EARLY.name, "converged"):
        return CONVERGED if text == "converged" else EARLY
    if text.isdigit() and (n := int(text)) >= 1:
        return Budget(f"{n} updates", n, what=f"{n} updates, each run scored at its end")
    raise ValueError(f"--budget {text}: give early, converged or a number of updates >= 1")
