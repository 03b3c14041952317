"""``python -m fastpals.env``: the report lines, the JSON form, and the keys of ``fastpals.env.collect()``."""

import json
import os
import subprocess
import sys

import pytest
import torch

import fastpals.env as fenv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("triton_kernels", "flash_attn", "apex_fused_layer_norm", "apex_fused_adam")


def run_env(*args, **env):
    """``python -m fastpals.env *args``'s output, with ``env`` over this environment (None: unset)."""
    full_env = {**os.environ, **env}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    return subprocess.run(
        [sys.executable, "-m", "fastpals.env", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=full_env,
        timeout=120,
        check=True,
    ).stdout


@pytest.fixture(scope="module")
def report_lines():
    return run_env(FASTPALS_KERNELS=None).splitlines()


def _line(lines, prefix):
    found = [ln for ln in lines if ln.startswith(prefix)]
    assert len(found) == 1, f"expected one line starting with {prefix!r} in:\n" + "\n".join(lines)
    return found[0]


def test_report_lists_versions(report_lines):
    import importlib.metadata

    assert _line(report_lines, "fastpals: ") == "fastpals: 0.1.0"
    assert _line(report_lines, "python: ").startswith(f"python: {sys.version.split()[0]} (")
    assert _line(report_lines, "torch: ").startswith(f"torch: {torch.__version__}")
    for name in ("triton", "deepspeed", "transformers", "tokenizers", "safetensors"):
        try:
            expected = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            expected = "not installed"
        assert _line(report_lines, f"{name}: ") == f"{name}: {expected}"


def test_report_device_line(report_lines):
    line = _line(report_lines, "device: ")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        assert torch.cuda.get_device_name() in line
        assert f"compute capability {major}.{minor}" in line
    else:
        assert line.startswith("device: cpu ")
        assert f"({os.cpu_count()} cores" in line


def test_report_backends_say_why(report_lines):
    start = report_lines.index("backends:")
    labels = [
        "Triton kernels",
        "flash-attn",
        "apex FusedLayerNorm",
        "apex FusedAdam",
    ]
    block = report_lines[start + 1 : start + 1 + len(labels)]
    for label, line in zip(labels, block):
        assert line.startswith(f"  {label}: yes (") or line.startswith(f"  {label}: no ("), line
        assert line.endswith(")") and len(line) > len(label) + 12
    if not torch.cuda.is_available():
        # without a GPU, none of the CUDA-only backends can be available, and the line must say so
        for line in block[1:]:
            assert ": no (" in line, line
    kernels = _line(report_lines, "FASTPALS_KERNELS: ")
    assert kernels.startswith("FASTPALS_KERNELS: unset = auto -> ")


def test_kernels_env_is_reported(monkeypatch):
    monkeypatch.setenv("FASTPALS_KERNELS", "reference")
    lines = fenv.format_report(fenv.collect()).splitlines()
    assert (
        _line(lines, "FASTPALS_KERNELS: ")
        == "FASTPALS_KERNELS: reference -> the PyTorch reference ops everywhere"
    )
    monkeypatch.setenv("FASTPALS_KERNELS", "fastest")
    lines = fenv.format_report(fenv.collect()).splitlines()
    assert "'fastest' is not one of auto, triton, reference" in _line(lines, "FASTPALS_KERNELS: ")


def test_json_output_matches_collect_keys():
    info = json.loads(run_env("--json"))
    assert set(info) == set(fenv.collect())


def test_collect_keys_and_types(monkeypatch):
    monkeypatch.delenv("FASTPALS_KERNELS", raising=False)
    info = fenv.collect()
    assert set(info) == {
        "fastpals",
        "python",
        "python_executable",
        "platform",
        "versions",
        "torch_cuda",
        "device",
        "backends",
        "kernels",
        "dispatch",
    }
    assert set(info["versions"]) == set(fenv.PACKAGES)
    assert info["versions"]["torch"] == torch.__version__
    assert set(info["backends"]) == set(BACKENDS)
    for status in info["backends"].values():
        assert set(status) == {"available", "reason"}
        assert isinstance(status["available"], bool) and status["reason"]
    assert info["kernels"]["mode"] == "auto" and info["kernels"]["value"] is None
    dev = info["device"]
    if torch.cuda.is_available():
        assert dev["type"] == "cuda" and set(dev) >= {"name", "capability", "total_memory_bytes"}
    else:
        assert dev == {
            "type": "cpu",
            "name": dev["name"],
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
        }
        assert not info["backends"]["flash_attn"]["available"]
    json.dumps(info)  # serialisable as is


def test_triton_kernels_follow_kernels_available(monkeypatch):
    import fastpals_kernels as kernels

    ok, reason = kernels.available()
    assert fenv.collect()["backends"]["triton_kernels"] == {"available": ok, "reason": reason}


def test_main_accepts_no_argv(capsys):
    assert fenv.main() == 0
    assert capsys.readouterr().out.startswith("fastpals: ")
    with pytest.raises(SystemExit):
        fenv.main(["--no-such-option"])


def test_report_prints_the_dispatch_decision_per_op(report_lines):
    from fastpals_kernels.dispatch import OPS

    start = report_lines.index(next(ln for ln in report_lines if ln.startswith("dispatch (auto, ")))
    where = "cpu" if not torch.cuda.is_available() else "sm_"
    assert where in report_lines[start]
    block = report_lines[start + 1 : start + 1 + 3 * len(OPS)]
    for op in OPS:
        for dtype in ("fp32", "fp16", "bf16"):
            line = next(ln for ln in block if ln.startswith(f"  {op} {dtype}: "))
            assert line.endswith(")") and " (" in line, line


@pytest.mark.parametrize(
    ("cap", "pal", "gram"),
    [
        ("7.5", "sdpa", "triton"),
        ("8.0", "triton", "triton"),
        ("9.0", "triton", "triton"),
        ("cpu", "reference", "reference"),
    ],
)
def test_capability_option_shows_another_device(cap, pal, gram):
    info = json.loads(run_env("--json", "--capability", cap))
    ops = info["dispatch"]["ops"]
    assert ops["pal"]["fp16"]["backend"] == pal
    assert ops["gram"]["fp32"]["backend"] == gram
    assert info["dispatch"]["capability"] == (None if cap == "cpu" else cap)


def test_bad_capability_is_a_usage_error():
    with pytest.raises(SystemExit):
        fenv.main(["--capability", "ampere"])
