"""Adapters record the encoder they were trained with (``fastpals.encoder.fingerprint``): another run's ``pals/`` beside
this encoder is refused with one line (``force=True`` / ``--force`` accepts it); ``adapters_only`` warns when
the encoder trained."""

from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

from fastpals import MultiTaskBert, load_pals
from fastpals.adapters.format import ADAPTER_SUBFOLDER
from fastpals.encoder.bert import PALConfig
from fastpals.encoder.fingerprint import EncoderMismatchError, encoder_fingerprint

sys.path.insert(0, str(Path(__file__).parent))
from train_fixtures import make_tiny_model  # noqa: E402

TASKS = ("sst", "para", "sts")
PAL = PALConfig(hidden=12, num_heads=2)


def _trained(base: Path, seed: int) -> MultiTaskBert:
    """A model on ``base`` whose encoder and PALs moved (as training moves them)."""
    model = MultiTaskBert.from_base(base, TASKS, PAL)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    return model


def _logits(model: MultiTaskBert) -> torch.Tensor:
    ids = torch.randint(5, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(ids, torch.ones_like(ids), task_ids=torch.tensor([0, 2])).logits


def test_another_runs_pals_beside_this_encoder_are_refused_and_force_accepts(tmp_path):
    base = make_tiny_model(tmp_path / "base")
    a, b = _trained(base, 1), _trained(base, 2)
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    torch.testing.assert_close(_logits(MultiTaskBert.from_pretrained(tmp_path / "a")), _logits(a.eval()))
    # run a's pals/ in run b's folder: b's encoder, a's adapter
    shutil.rmtree(tmp_path / "b" / ADAPTER_SUBFOLDER)
    shutil.copytree(tmp_path / "a" / ADAPTER_SUBFOLDER, tmp_path / "b" / ADAPTER_SUBFOLDER)
    with pytest.raises(EncoderMismatchError) as err:
        MultiTaskBert.from_pretrained(tmp_path / "b")
    message = str(err.value)
    assert "\n" not in message and "trained with another encoder" in message and "force=True" in message
    mixed = MultiTaskBert.from_pretrained(tmp_path / "b", force=True)  # accepted on request
    assert not torch.allclose(_logits(mixed), _logits(a.eval()))  # what the check protects against


@pytest.mark.filterwarnings("ignore:load_pals. BertModel has no place:UserWarning")  # the heads
def test_hf_encoder_fingerprints_like_fastpals_and_load_pals_checks_it(tmp_path):
    """The fingerprint reads HF ``BertModel`` names, so ``load_pals`` into ``AutoModel`` of the full folder
    matches, and into another encoder is refused."""
    from transformers import AutoModel

    base = make_tiny_model(tmp_path / "base")
    model = _trained(base, 1)
    model.save_pretrained(tmp_path / "run")
    hf = AutoModel.from_pretrained(tmp_path / "run")
    assert encoder_fingerprint(hf) == encoder_fingerprint(model.bert)
    load_pals(hf, tmp_path / "run")  # its own encoder: accepted
    other = AutoModel.from_pretrained(base)
    with pytest.raises(EncoderMismatchError, match="load_pals: the adapter in .* another encoder"):
        load_pals(other, tmp_path / "run")
    load_pals(other, tmp_path / "run", force=True)


def test_adapters_only_warns_when_the_encoder_trained(tmp_path):
    base = make_tiny_model(tmp_path / "base")
    trained = _trained(base, 1)
    with pytest.warns(UserWarning, match=r"encoder trained .*adapters_only=False\) to keep the encoder"):
        trained.save_pretrained(tmp_path / "only", adapters_only=True)
    # that adapter is then refused beside its base encoder, as the warning said
    with pytest.raises(EncoderMismatchError):
        MultiTaskBert.from_pretrained(tmp_path / "only", base_model=base)
    # PALs and heads trained, the encoder frozen: no warning, and the adapter loads beside its base
    frozen = MultiTaskBert.from_base(base, TASKS, PAL)
    with torch.no_grad():
        for name, p in frozen.named_parameters():
            if name.startswith("heads.") or ".pal" in name or "pal_" in name:
                p.add_(0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        frozen.save_pretrained(tmp_path / "frozen", adapters_only=True)
    reloaded = MultiTaskBert.from_pretrained(tmp_path / "frozen", base_model=base)
    torch.testing.assert_close(_logits(reloaded), _logits(frozen.eval()))


def test_predict_refuses_a_mismatched_adapter_in_one_line_and_force_accepts(tmp_path, capsys):
    from fastpals.commands.predict import main

    base = make_tiny_model(tmp_path / "base")
    a, b = _trained(base, 1), _trained(base, 2)
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    shutil.copy(base / "vocab.txt", tmp_path / "b" / "vocab.txt")
    shutil.rmtree(tmp_path / "b" / ADAPTER_SUBFOLDER)
    shutil.copytree(tmp_path / "a" / ADAPTER_SUBFOLDER, tmp_path / "b" / ADAPTER_SUBFOLDER)
    assert main([str(tmp_path / "b"), "--task", "sst", "--text", "good movie"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another encoder" in err[0] and "--force" in err[0]
    assert main([str(tmp_path / "b"), "--task", "sst", "--text", "good movie", "--force"]) == 0
