"""The benchmark infrastructure: report generation from synthetic results, side-by-side ratios, the memory
report's batch search, the measurement helpers, and that the bench suites collect the way CI runs them."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # bench/ is a folder of the checkout, not an installed package
    sys.path.insert(0, ROOT)

from bench import common, report  # noqa: E402
from bench.memory_report import largest_batch  # noqa: E402
from bench.memory_report import main as memory_main  # noqa: E402
from bench.training import StepConfig, side_by_side  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(variant, seconds, peak, tasks=3, precision="fp32"):
    return {
        "variant": variant,
        "num_tasks": tasks,
        "batch": 16,
        "length": 32,
        "precision": precision,
        "model": "minilm-l6",
        "device": "cpu",
        "seed": 0,
        "device_type": "cpu",
        "pal_path": None if variant == "bert" else "reference",
        "median_s": seconds,
        "peak_bytes": peak,
        "peak_kind": "cpu_peak_rss_growth",
    }


RECORDS = [
    _record("bert", 0.5, 400 * 2**20),
    _record("pal_reference", 0.6, 500 * 2**20),
    _record("pal_pcgrad_reference", 3.0, 2000 * 2**20),
    _record("pal_pcgrad_fastpals", 1.2, 800 * 2**20),
    _record("pal_gem_fastpals", 1.5, None),
    _record("bert", 1.0, 450 * 2**20, tasks=8),
    _record("pal_reference", 2.0, 900 * 2**20, tasks=8),
]


def _write(path, doc):
    path.write_text(json.dumps(doc), encoding="utf-8")


def _steps_doc():
    return {
        "name": "steps_cpu",
        "suite": "train_steps",
        "date": "2026-11-22T07:00:00+00:00",
        "commit": "abc123",
        "device": "CPU Test, 2 cores",
        "device_type": "cpu",
        "ratio_method": "synthetic",
        "records": RECORDS,
        "side_by_side": side_by_side(RECORDS),
    }


def _memory_doc(entries, date):
    caps = {
        "T4 16GB": {"cap_bytes": 14 * 2**30, "fraction": 0.18},
        "80GB A100/H100": {"cap_bytes": 78 * 2**30},
    }
    return {
        "suite": "memory_report",
        "name": "memory_fp16",
        "date": date,
        "device": "NVIDIA H100 80GB HBM3 (sm_90, 79.2 GiB)",
        "precision": "fp16",
        "length": 128,
        "caps": caps,
        "entries": entries,
    }


def _mem_entry(variant, t, t4, big, peak):
    return {
        "variant": variant,
        "num_tasks": t,
        "peak_at_32_bytes": peak,
        "max_batch": {"T4 16GB": {"batch": t4}, "80GB A100/H100": {"batch": big}},
    }


def test_side_by_side_ratios():
    groups = side_by_side(RECORDS)["groups"]
    assert [g["key"]["num_tasks"] for g in groups] == [3, 8]
    g3 = {v["variant"]: v for v in groups[0]["variants"]}
    assert g3["pal_reference"]["time_vs_bert"] == pytest.approx(1.2)
    assert g3["pal_pcgrad_reference"]["memory_vs_bert"] == pytest.approx(5.0)
    assert g3["pal_gem_fastpals"]["memory_vs_bert"] is None  # no peak measured: no ratio, not a made-up one
    pairs = {(p["numerator"], p["denominator"]): p for p in groups[0]["pairs"]}
    assert pairs[("pal_pcgrad_fastpals", "pal_pcgrad_reference")]["time_ratio"] == pytest.approx(0.4)
    assert pairs[("pal_pcgrad_fastpals", "pal_pcgrad_reference")]["memory_ratio"] == pytest.approx(0.4)
    assert ("pal_fused", "pal_reference") not in pairs  # absent variant: the pair is left out
    assert groups[1]["variants"][1]["time_vs_bert"] == pytest.approx(2.0)


def test_side_by_side_prefers_interleaved_times():
    inter = [
        {
            "model": "minilm-l6",
            "device_type": "cpu",
            "precision": "fp32",
            "num_tasks": 3,
            "batch": 16,
            "length": 32,
            "rounds": 3,
            "medians_s": {"bert": 1.0, "pal_pcgrad_reference": 5.0, "pal_pcgrad_fastpals": 1.5},
        }
    ]
    groups = side_by_side(RECORDS, inter)["groups"]
    assert (
        groups[0]["timing"] == "interleaved, 3 rounds" and groups[1]["timing"] == "each configuration alone"
    )
    g3 = {v["variant"]: v for v in groups[0]["variants"]}
    assert g3["pal_pcgrad_reference"]["time_vs_bert"] == pytest.approx(5.0)
    assert g3["pal_reference"]["median_s"] == pytest.approx(0.6)  # not in the interleaved run: its own median
    pairs = {(p["numerator"], p["denominator"]): p for p in groups[0]["pairs"]}
    assert pairs[("pal_pcgrad_fastpals", "pal_pcgrad_reference")]["time_ratio"] == pytest.approx(0.3)
    assert RECORDS[0]["median_s"] == 0.5  # the records themselves are left alone


def test_report_tables_and_charts(tmp_path):
    _write(tmp_path / "steps_cpu_1.json", _steps_doc())
    _write(
        tmp_path / "memory_fp16_a.json",
        _memory_doc([_mem_entry("bert", 3, 100, 600, 3 * 2**30)], "2026-11-22T07:00:00+00:00"),
    )
    _write(
        tmp_path / "memory_fp16_b.json",
        _memory_doc(
            [
                _mem_entry("pal_fused", 3, 90, 550, int(3.5 * 2**30)),
                _mem_entry("bert", 8, 99, 590, 3 * 2**30),
            ],
            "2026-11-22T08:00:00+00:00",
        ),
    )
    _write(tmp_path / "pal_cuda_T3_x.json", {"name": "pal", "date": "d", "speedup_fused_over_reference": 2.5})
    out = tmp_path / "out"
    path = report.build_report(tmp_path, out)
    text = path.read_text()
    assert "| BERT (no PAL) | — | 500.0 | 32.0 | 400 | 1.00x | 1.00x |" in text
    assert (
        "| BERT + PAL + PCGrad, Pytorch-PCGrad-style reference | reference | 3,000.0 | 5.3 | 2,000 | 6.00x | 5.00x |"
        in text
    )
    assert "| pal_pcgrad_fastpals / pal_pcgrad_reference | 0.40x | 0.40x |" in text
    assert "| BERT + PAL + GEM, fastpals | reference | 1,500.0 | 10.7 | n/a | 3.00x | n/a |" in text
    # two memory files of one device and precision are merged; rows ordered by T, then configuration
    assert "Merged from: `memory_fp16_a.json`, `memory_fp16_b.json`" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| BERT") and ("| 3 |" in ln or "| 8 |" in ln)]
    assert rows[0].startswith("| BERT (no PAL) | 3 | 3.00 | 100 | 600 |")
    assert rows[1].startswith("| BERT + PAL, fused | 3 | 3.50 | 90 | 550 |")
    assert rows[2].startswith("| BERT (no PAL) | 8 | 3.00 | 99 | 590 |")
    assert "| `pal_cuda_T3_x.json` | d | unknown | speedup_fused_over_reference = 2.50 |" in text
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert (
        len(pngs) == 2
        and any(n.startswith("steps_cpu") for n in pngs)
        and any(n.startswith("memory_") for n in pngs)
    )
    for name in pngs:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000
        assert f"]({name})" in text


def test_report_empty_folder_and_bad_files(tmp_path, capsys):
    text = report.build_report(tmp_path).read_text()
    assert "No memory report yet" in text and "No training-step results yet" in text
    (tmp_path / "broken.json").write_text('{"suite": "train_steps",\n  oops}')
    with pytest.raises(report.ResultsError, match=r"broken\.json:2: not valid JSON"):
        report.build_report(tmp_path)
    assert report.main(["--results", str(tmp_path)]) == 1
    assert "broken.json" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text(json.dumps({"suite": "train_steps", "records": []}))
    with pytest.raises(report.ResultsError, match=r"broken\.json: missing field\(s\) side_by_side"):
        report.build_report(tmp_path)
    assert report.main(["--results", str(tmp_path / "nowhere")]) == 1


@pytest.mark.parametrize("limit", [1, 7, 100, 383, 4096])
@pytest.mark.parametrize("predicted", [1, 50, 383, 384, 5000])
def test_largest_batch_search_is_exact(limit, predicted):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= limit

    good, bad = largest_batch(fits, predicted, max_batch=4096)
    assert good == limit
    assert bad == (None if limit == 4096 else limit + 1)
    assert len(calls) <= 40
    assert all(1 <= b <= 4096 for b in calls)


def test_largest_batch_resolution_and_nothing_fits():
    good, bad = largest_batch(lambda b: b <= 1000, 10, max_batch=4096, resolution=16)
    assert good <= 1000 < bad and bad - good <= 16
    assert largest_batch(lambda b: False, 64, max_batch=4096) == (None, 1)
    with pytest.raises(ValueError, match="resolution"):
        largest_batch(lambda b: True, 1, 8, resolution=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_memory_report_refuses_without_cuda(capsys):
    assert memory_main([]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_step_config_validation():
    with pytest.raises(ValueError, match="variant"):
        StepConfig("pal_magic", 3, 16, 32)
    with pytest.raises(ValueError, match="CUDA only"):
        StepConfig("pal_fused", 3, 16, 32)
    with pytest.raises(ValueError, match="at least one example per task"):
        StepConfig("bert", 8, 4, 32)


def test_write_results_header(tmp_path):
    path = common.write_results("steps_cpu", {"x": 1}, tmp_path)
    doc = json.loads(path.read_text())
    assert path.name.startswith("steps_cpu_") and doc["x"] == 1
    assert set(doc) >= {"name", "date", "commit", "device", "device_type", "env"}
    assert doc["env"]["versions"]["torch"] == torch.__version__
    assert len(doc["commit"].split("-")[0]) == 40 or doc["commit"] == "unknown"
    with pytest.raises(ValueError, match="plain file-name stem"):
        common.write_results("../evil", {}, tmp_path)


def test_step_timer_records_every_call():
    n = []
    timer = common.StepTimer(lambda: n.append(1), "cpu")
    for _ in range(4):
        timer()
    assert len(n) == 4 and len(timer.measured(1)) == 3
    assert timer.median(1) >= 0


@pytest.mark.skipif(not common.cpu_peak_supported()[0], reason="needs Linux /proc/self/clear_refs and glibc")
def test_cpu_peak_memory_sees_a_temporary_allocation():
    big = 64 * 2**20
    with common.CpuPeakMemory() as m:
        x = torch.ones(big // 4)  # 64 MiB, touched
        del x
    growth = m.peak_bytes - m.start_bytes
    assert 0.9 * big <= growth <= 1.3 * big, growth
    with common.CpuPeakMemory() as m:  # nothing allocated: the reset peak stays near the current set
        pass
    assert m.peak_bytes - m.start_bytes < 8 * 2**20


def test_bench_suites_collect_for_ci():
    """``pytest bench/ --benchmark-only -m "slow or not slow" --collect-only``: every suite imports and the step
    cases are there (the long ones too)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "bench/",
            "--benchmark-only",
            "-m",
            "slow or not slow",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ids = [ln for ln in out.stdout.splitlines() if "test_bench_steps.py::" in ln]
    precisions = 2 if torch.cuda.is_available() else 1
    assert len(ids) == precisions * 2 * 7, (
        ids
    )  # per precision and T: 6 configurations, then the interleaved test
    for i in range(0, len(ids), 7):  # each group's configurations run just before its interleaved comparison
        assert all("test_train_step[" in x for x in ids[i : i + 6]) and "interleaved[" in ids[i + 6]
    if not torch.cuda.is_available():
        assert ids[6] == "bench/test_bench_steps.py::test_side_by_side_interleaved[fp32-T3]"
        assert "bench/test_bench_steps.py::test_train_step[fp32-T8-pal_pcgrad_reference]" in ids
