"""PAL layers and the multi-task model (reference path, CPU)."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from inputs import padded_batch

import fastpals
from fastpals.encoder.bert import BertConfig, BertModel, PALConfig
from fastpals.model.multitask import MultiTaskBert, MultiTaskConfig, TaskSpec, count_parameters, get_task

TINY = BertConfig(
    vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip
PAL = PALConfig(num_tasks=3, hidden=12, num_heads=2, top_blocks=2, top_heads=3)


def _pal_model(pal=PAL, seed=0):
    torch.manual_seed(seed)
    return BertModel(TINY, pal=pal).eval()


# ---------------------------------------------------------------------------------------------------------------
# An independent transcription of BERT + PAL, one example at a time, straight from the formulas
# ---------------------------------------------------------------------------------------------------------------
def _ln(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _mha(x, wq, bq, wk, bk, wv, bv, heads, valid):
    q, k, v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv
    dh = q.shape[-1] // heads
    outs = []
    for hd in range(heads):
        sl = slice(hd * dh, (hd + 1) * dh)
        s = q[:, sl] @ k[:valid, sl].T / math.sqrt(dh)
        outs.append(torch.softmax(s, -1) @ v[:valid, sl])
    return torch.cat(outs, -1)


def _transcribe(model, ids, types, valid, task):
    sd = {k: v.double() for k, v in model.state_dict().items()}
    cfg, pal = model.config, model.pal_config
    eps = cfg.layer_norm_eps
    n = ids.shape[0]
    x = sd["embeddings.word_embeddings.weight"][ids] + sd["embeddings.position_embeddings.weight"][:n]
    x = _ln(x + sd["embeddings.token_type_embeddings.weight"][types], sd["embeddings.LayerNorm.weight"],
            sd["embeddings.LayerNorm.bias"], eps)  # fmt: skip
    d_s = pal.hidden
    for i in range(cfg.num_hidden_layers):
        p = f"encoder.layer.{i}."
        a = _mha(x, *(sd[p + f"attention.self.{n}.{w}"] for n in ("query", "key", "value") for w in ("weight", "bias")),
                 cfg.num_attention_heads, valid)  # fmt: skip
        a = _ln(a @ sd[p + "attention.output.dense.weight"].T + sd[p + "attention.output.dense.bias"] + x,
                sd[p + "attention.output.LayerNorm.weight"], sd[p + "attention.output.LayerNorm.bias"], eps)  # fmt: skip
        f = F.gelu(a @ sd[p + "intermediate.dense.weight"].T + sd[p + "intermediate.dense.bias"])
        f = f @ sd[p + "output.dense.weight"].T + sd[p + "output.dense.bias"]
        ts = 0.0
        if p + "pal.qkv_weight" in sd:
            ve, vd = sd["pal_projections.enc_weight"][task], sd["pal_projections.dec_weight"][task]
            be, bd = sd["pal_projections.enc_bias"][task], sd["pal_projections.dec_bias"][task]
            w, b = sd[p + "pal.qkv_weight"][task], sd[p + "pal.qkv_bias"][task]
            s = x @ ve.T + be
            m = _mha(s, w[:d_s], b[:d_s], w[d_s : 2 * d_s], b[d_s : 2 * d_s], w[2 * d_s :], b[2 * d_s :],
                     pal.num_heads, valid)  # fmt: skip
            ts = F.gelu(m @ vd.T + bd)
        x = _ln(f + a + ts, sd[p + "output.LayerNorm.weight"], sd[p + "output.LayerNorm.bias"], eps)
    return x


def test_default_pal_equals_transcription_of_the_formulas():
    model = _pal_model()
    ids, mask, types = padded_batch()
    tasks = torch.tensor([2, 0, 1, 0, 2])
    with torch.no_grad():
        out = model(ids, mask, types, tasks).last_hidden_state
    for b in range(ids.shape[0]):
        valid = int(mask[b].sum())
        ref = _transcribe(model, ids[b], types[b], valid, int(tasks[b]))
        assert (out[b, :valid].double() - ref[:valid]).abs().max() <= 1e-5


def test_zero_decoder_equals_base_encoder_exactly():
    pal = dataclasses.replace(PAL, zero_init_decoder=True)
    torch.manual_seed(0)
    base = BertModel(TINY).eval()
    model = BertModel(TINY, pal=pal).eval()
    model.load_state_dict(base.state_dict(), strict=False)
    ids, mask, types = padded_batch()
    with torch.no_grad():
        a = base(ids, mask, types)
        b = model(ids, mask, types, torch.tensor([0, 1, 2, 1, 0]))
    assert torch.equal(a.last_hidden_state, b.last_hidden_state)
    assert torch.equal(a.pooler_output, b.pooler_output)


def test_mixed_batch_equals_single_task_batches():
    model = _pal_model()
    ids, mask, types = padded_batch(6)
    tasks = torch.tensor([0, 2, 1, 1, 0, 2])
    with torch.no_grad():
        mixed = model(ids, mask, types, tasks).last_hidden_state
        for t in range(3):
            rows = (tasks == t).nonzero(as_tuple=True)[0]
            single = model(ids[rows], mask[rows], types[rows], tasks[rows]).last_hidden_state
            m = mask[rows].bool()
            assert (single - mixed[rows])[m].abs().max() <= 1e-6


def test_packed_path_equals_padded_path():
    model = _pal_model()
    ids, mask, types = padded_batch(4)
    tasks = torch.tensor([1, 0, 2, 1])
    with torch.no_grad():
        a = model(ids, mask, types, tasks).last_hidden_state
        b = model(ids, mask, types, tasks, unpad=True).last_hidden_state
    assert (a - b)[mask.bool()].abs().max() <= 1e-5


def test_parameter_count_bert_base_three_tasks():
    base = BertConfig()
    model = BertModel(base, pal=PALConfig(num_tasks=3))
    counts = count_parameters(model)
    assert counts["pal"] == 5_459_508
    assert counts["pal_projections"] == 3 * 314_316
    assert counts["pal_attention"] == 3 * 12 * 125_460
    assert counts["encoder"] == 109_482_240  # bert-base-uncased BertModel
    half = count_parameters(BertModel(base, pal=PALConfig.half(num_tasks=1)))["pal"]
    assert half == 768 * 276 + 276 + 276 * 768 + 768 + 6 * 3 * (276 * 276 + 276)  # ≈ 1.80M per task
    embert = count_parameters(BertModel(base, pal=PALConfig(num_tasks=1, variant="embert")))
    assert embert["embert"] == embert["pal"] == 27_648


VARIANTS = {
    "default": PAL,
    "12_heads": dataclasses.replace(PAL, num_heads=4),
    "no_gelu": dataclasses.replace(PAL, gelu=False),
    "per_layer_projections": dataclasses.replace(PAL, shared_projections=False),
    "top_k_layers": dataclasses.replace(PAL, layers=2),
    "explicit_layers": dataclasses.replace(PAL, layers=[0, 2]),
    "half": PALConfig.half(num_tasks=3, layers=2),
    "gate": dataclasses.replace(PAL, gate=True, gate_init=0.5),
    "top": dataclasses.replace(PAL, variant="top"),
    "top_parallel": dataclasses.replace(PAL, variant="top_parallel"),
    "top_parallel_same": dataclasses.replace(PAL, variant="top_parallel", top_shares_projections=True),
    "embert": dataclasses.replace(PAL, variant="embert"),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_trains_only_what_it_should(name):
    model = _pal_model(VARIANTS[name]).train()
    ids, mask, types = padded_batch()
    tasks = torch.tensor([0, 0, 2, 0, 2])  # task 1 absent
    out = model(ids, mask, types, tasks)
    (out.last_hidden_state.pow(2).mean() + out.pooler_output.sum()).backward()
    task_params = {n: p for n, p in model.named_parameters() if n.split(".")[0] in ("pal_projections", "pal_top")
                   or ".pal." in n or n.endswith("task_embedding")}  # fmt: skip
    assert task_params, "variant has no task-specific parameters"
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        if n in task_params and p.dim() >= 1 and p.shape[0] == 3:
            assert p.grad[1].abs().max() == 0, f"{n}: task 1 absent but got gradient"
            assert p.grad[[0, 2]].abs().max() > 0, f"{n}: present tasks got no gradient"
    if name == "per_layer_projections":
        assert model.pal_projections is None and model.encoder.layer[0].pal.projections is not None
    if name in ("top_k_layers", "half"):
        assert model.encoder.layer[0].pal is None and model.encoder.layer[2].pal is not None
    if name == "top":
        assert all(layer.pal is None for layer in model.encoder.layer)


def test_invalid_task_ids_raise():
    model = _pal_model()
    ids, mask, types = padded_batch(3)
    with pytest.raises(ValueError, match="outside"):
        model(ids, mask, types, torch.tensor([0, 3, 1]))
    with pytest.raises(ValueError, match="outside"):
        model(ids, mask, types, torch.tensor([0, -1, 1]))
    with pytest.raises(TypeError, match="integer"):
        model(ids, mask, types, torch.tensor([0.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="shape"):
        model(ids, mask, types, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="Tensor"):
        model(ids, mask, types, [0, 1, 2])
    with pytest.raises(ValueError, match="task_ids"):
        model(ids, mask, types)


def test_bad_pal_config_raises():
    with pytest.raises(ValueError, match="divide"):
        BertModel(TINY, pal=PALConfig(hidden=10, num_heads=3))
    with pytest.raises(ValueError, match="variant"):
        BertModel(TINY, pal=PALConfig(variant="sideways"))
    with pytest.raises(ValueError, match="top k"):
        BertModel(TINY, pal=PALConfig(layers=7))


# ---------------------------------------------------------------------------------------------------------------
# Multi-task model
# ---------------------------------------------------------------------------------------------------------------
def _mt(tasks=("sst", "para", "sts"), pal=PAL):
    torch.manual_seed(0)
    return MultiTaskBert(MultiTaskConfig(TINY, [get_task(t) for t in tasks], pal)).eval()


def test_multitask_heads_losses_and_predictions():
    cfimdb_extra = ("sst", "para", "sts", "cfimdb")  # a fourth task beyond the three
    model = _mt(cfimdb_extra)
    ids, mask, types = padded_batch(8)
    tasks = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    labels = torch.tensor([4.0, 1.0, 3.2, 0.0, 1.0, 0.0, 0.5, 1.0])
    out = model(ids, mask, types, tasks)
    assert out.logits.shape == (8, 5)
    total, per = model.loss(out, labels)
    assert set(per) == {"sst", "para", "sts", "cfimdb"}
    assert torch.allclose(total, sum(per.values()))
    # Per-task loss equals the loss computed on that task's rows alone.
    sts = out.logits[tasks == 2, 0]
    assert torch.allclose(per["sts"], F.mse_loss(sts, labels[tasks == 2] / 5))
    assert torch.allclose(per["sst"], F.cross_entropy(out.logits[tasks == 0], labels[tasks == 0].long()))
    preds = model.predict(out)
    assert preds[0] in range(5) and preds[1] in (0.0, 1.0) and 0.0 <= preds[2] <= 5.0
    total.backward()
    assert model.heads["cfimdb"].out.weight.grad.abs().max() > 0


def test_multitask_too_long_a_sequence_is_an_error_naming_the_fix():
    n = TINY.max_position_embeddings + 1
    with pytest.raises(ValueError, match=r"max_position_embeddings 64: encode with max_length <= 64"):
        _mt(("sst",))(
            torch.ones(1, n, dtype=torch.long), torch.ones(1, n, dtype=torch.long), None, torch.tensor([0])
        )


@pytest.mark.parametrize("mode", ["sbert_cosine", "sbert_concat"])
@pytest.mark.parametrize("pooling", ["cls", "mean", "max"])
def test_siamese_pair_heads(mode, pooling):
    sts = TaskSpec("sts", "regression", pair=True, pair_mode=mode, pooling=pooling, label_scale=5.0,
                   loss="cosine" if mode == "sbert_cosine" else "mse", head="mlp")  # fmt: skip
    model = _mt((get_task("sst"), sts))
    ids, mask, types = padded_batch(4)
    ids_b, mask_b, _ = padded_batch(4, 7, seed=1)
    tasks = torch.tensor([1, 1, 0, 1])
    out = model(ids, mask, types, tasks, input_ids_b=ids_b, attention_mask_b=mask_b)
    total, per = model.loss(out, torch.tensor([1.0, 4.0, 2.0, 2.5]))
    total.backward()
    if mode == "sbert_cosine":
        assert out.logits[tasks == 1, 0].abs().max() <= 1.0 + 1e-6
    with pytest.raises(ValueError, match="input_ids_b"):
        model(ids, mask, types, tasks)


def test_task_spec_validation():
    with pytest.raises(ValueError, match="sbert_cosine"):
        TaskSpec("x", "binary", pair=True, pair_mode="sbert_cosine")
    with pytest.raises(ValueError, match="loss"):
        TaskSpec("x", "classification", num_labels=3, loss="mse")
    with pytest.raises(ValueError, match="unknown task"):
        get_task("mnli")


@pytest.mark.parametrize("adapters_only", [False, True])
def test_save_load_round_trip(tmp_path, adapters_only):
    if adapters_only:
        model = MultiTaskBert.from_base("minilm-l6", pal=PALConfig(hidden=24, num_heads=2))
    else:
        model = _mt()
    model.eval()
    model.save_pretrained(tmp_path, adapters_only=adapters_only)
    loaded = MultiTaskBert.load(tmp_path)  # the former name of from_pretrained
    assert not loaded.training
    ids, mask, types = padded_batch()
    ids = ids.clamp(max=99)
    tasks = torch.tensor([0, 1, 2, 0, 1])
    with torch.no_grad():
        assert torch.equal(model(ids, mask, types, tasks).logits, loaded(ids, mask, types, tasks).logits)
    if adapters_only:
        from safetensors.torch import load_file

        keys = load_file(str(tmp_path / "adapter_model.safetensors")).keys()
        assert keys and all(k.startswith("heads.") or "pal" in k for k in keys)


def test_load_mismatch_is_reported(tmp_path):
    _mt().save_pretrained(tmp_path)
    import json

    path = tmp_path / "pals" / "adapter_config.json"
    meta = json.loads(path.read_text())
    meta["pal_config"]["hidden"] = 16
    meta["pal_config"]["num_heads"] = 2
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="qkv_weight"):
        MultiTaskBert.from_pretrained(tmp_path)


def test_public_names():
    assert fastpals.PALConfig is PALConfig and fastpals.MultiTaskBert is MultiTaskBert
    assert fastpals.count_parameters is count_parameters and fastpals.BertModel is BertModel
