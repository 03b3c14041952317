"""PAL variants are one class each (fastpals.encoder.pal_variants): the built-in registry, the typed PAL op options, and a
new variant defined and registered in this file alone (LHUC), which then works everywhere: BertModel and
MultiTaskBert, padded and packed forward, backward, the task-specific rule, count_parameters, saving and loading.
"""

import json

import pytest
import torch
from inputs import padded_batch
from torch import nn

from fastpals import MultiTaskBert, count_parameters, freeze_shared_parameters, inject_pals, is_task_specific
from fastpals.adapters.format import ADAPTER_CONFIG_NAME, ADAPTER_SUBFOLDER
from fastpals.data.layout import BatchLayout, make_layout
from fastpals.encoder.bert import BertConfig, BertModel, PALConfig
from fastpals.encoder.pal_variants import (
    PAL_VARIANTS,
    EmBERT,
    NoPAL,
    PALPreset,
    PALVariant,
    Parallel,
    Top,
    TopParallel,
    pal_presets,
    register_pal_variant,
    unregister_pal_variant,
)
from fastpals.functional import PALWeights, pal_reference
from fastpals.model.multitask import MultiTaskConfig, get_task

TINY = BertConfig(
    vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip
TASKS = torch.tensor([2, 0, 1, 0, 2])


# ---------------------------------------------------------------------------------------------------------------
# A new variant, entirely here: LHUC (Swietojanski & Renals 2014, in Bert-n-Pals' code) scales each layer's output
# by a per-task 2·sigmoid(v_t), v_t zero-initialised (so the model starts as the base encoder)
# ---------------------------------------------------------------------------------------------------------------
class LHUC(PALVariant):
    name = "lhuc"
    parameter_names = ("pal_lhuc",)  # encoder.layer.{i}.pal_lhuc [T, d]
    count_categories = ("lhuc",)
    presets = {"lhuc": PALPreset({"variant": "lhuc"}, "per-task LHUC scaling of every layer's output")}

    def add_parameters(self, model, pal):
        for layer in model.encoder.layer:
            layer.pal_lhuc = nn.Parameter(torch.zeros(pal.num_tasks, model.config.hidden_size))

    def layer_output(self, layer, out, layout):
        v = layout.per_row(layer.pal_lhuc.index_select(0, layout.task_ids))  # [B, 1, d] or [N, d]
        return out * (2.0 * torch.sigmoid(v)).to(out.dtype)


@pytest.fixture(scope="module", autouse=True)
def lhuc_registered():
    register_pal_variant(LHUC)
    yield PAL_VARIANTS["lhuc"]
    unregister_pal_variant("lhuc")


LHUC_PAL = PALConfig(num_tasks=3, variant="lhuc")


def _lhuc_model(seed=0, randomise=True):
    torch.manual_seed(seed)
    model = BertModel(TINY, pal=LHUC_PAL).eval()
    if randomise:  # move v away from 0 so the scaling matters
        with torch.no_grad():
            for layer in model.encoder.layer:
                layer.pal_lhuc.normal_(0.0, 1.0)
    return model


def _reference(model, ids, mask, types, tasks):
    """The same encoder without the variant's hook, scaling each layer's output by hand."""
    layout = make_layout(mask, tasks, False, tuple(ids.shape), 3)
    x = layout.to_rows(model.embeddings(ids, types))
    for layer in model.encoder.layer:
        variant, layer.pal_variant = layer.pal_variant, None
        try:
            x = layer(x, layout)
        finally:
            layer.pal_variant = variant
        x = x * 2.0 * torch.sigmoid(layer.pal_lhuc[tasks])[:, None, :]
    return layout.to_padded(x)


def test_new_variant_builds_from_its_name_only():
    model = _lhuc_model(randomise=False)
    assert LHUC_PAL.pal_variant is PAL_VARIANTS["lhuc"] and isinstance(model.pal_variant, LHUC)
    assert "lhuc" in PALConfig.VARIANTS
    names = [n for n, _ in model.named_parameters() if is_task_specific(n)]
    assert names == [f"encoder.layer.{i}.pal_lhuc" for i in range(3)]
    assert model.pal_projections is None and model.pal_top is None
    assert all(layer.pal is None for layer in model.encoder.layer)
    counts = count_parameters(model)
    assert counts["lhuc"] == counts["pal"] == 3 * 3 * 32
    assert counts["total"] == counts["encoder"] + counts["pal"]
    assert counts["pal_projections"] == counts["pal_attention"] == counts["pal_top"] == 0
    # zero-initialised: exactly the base encoder
    torch.manual_seed(0)
    base = BertModel(TINY).eval()
    ids, mask, types = padded_batch()
    with torch.no_grad():
        want = base(ids, mask, types).last_hidden_state
        assert torch.equal(model(ids, mask, types, TASKS).last_hidden_state, want)
    # freezing keeps the new parameters trainable
    freeze_shared_parameters(model)
    assert all(p.requires_grad for n, p in model.named_parameters() if "pal_lhuc" in n)
    # registry side: presets, the unknown-variant message, injection refused
    assert pal_presets()["lhuc"].fields == {"variant": "lhuc"}
    with pytest.raises(ValueError, match="choose one of parallel, top, top_parallel, embert, none, lhuc"):
        BertModel(TINY, pal=PALConfig(variant="sideways"))
    with pytest.raises(
        ValueError, match="variant='lhuc' is not supported by injection \\(only 'parallel'\\)"
    ):
        inject_pals(BertModel(TINY), LHUC_PAL)
    with pytest.raises(ValueError, match="already registered"):
        register_pal_variant(LHUC)


def test_new_variant_forward_padded_and_packed():
    model = _lhuc_model()
    ids, mask, types = padded_batch()
    with torch.no_grad():
        padded = model(ids, mask, types, TASKS).last_hidden_state
        ref = _reference(model, ids, mask, types, TASKS)
        valid = mask.bool()
        assert (padded - ref)[valid].abs().max() <= 1e-6
        unpad = model(ids, mask, types, TASKS, unpad=True).last_hidden_state
        assert (unpad - padded)[valid].abs().max() <= 1e-5
        lengths = mask.sum(1)
        flat = ids[valid]
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = lengths.cumsum(0)
        packed = model(flat, None, torch.zeros_like(flat), TASKS, cu_seqlens=cu, max_seqlen=9)
        assert packed.last_hidden_state.shape == (int(lengths.sum()), 32)
        assert (packed.last_hidden_state - padded[valid]).abs().max() <= 1e-5
        layout = BatchLayout.from_lengths(lengths.tolist(), TASKS.tolist(), 3)  # CPU length buckets
        bucketed = model(flat, None, torch.zeros_like(flat), layout=layout).last_hidden_state
        assert (bucketed - padded[valid]).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="task_ids"):
        model(ids, mask, types)


@pytest.mark.parametrize("packed", [False, True])
def test_new_variant_backward_reaches_only_present_tasks(packed):
    model = _lhuc_model().train()
    ids, mask, types = padded_batch()
    tasks = torch.tensor([0, 0, 2, 0, 2])  # task 1 absent
    if packed:
        flat = ids[mask.bool()]
        layout = BatchLayout.from_lengths(mask.sum(1).tolist(), tasks.tolist(), 3)
        out = model(flat, None, torch.zeros_like(flat), layout=layout)
    else:
        out = model(ids, mask, types, tasks)
    (out.last_hidden_state.pow(2).mean() + out.pooler_output.sum()).backward()
    for i, layer in enumerate(model.encoder.layer):
        g = layer.pal_lhuc.grad
        assert g is not None and g[1].abs().max() == 0, i
        assert g[[0, 2]].abs().max() > 0, i
    assert all(p.grad is not None for p in model.parameters())


def test_new_variant_multitask_save_pretrained_round_trip(tmp_path):
    torch.manual_seed(0)
    model = MultiTaskBert(MultiTaskConfig(TINY, [get_task(t) for t in ("sst", "para", "sts")], LHUC_PAL))
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            layer.pal_lhuc.normal_()
    counts = count_parameters(model)
    assert counts["lhuc"] == counts["pal"] == 3 * 3 * 32 and counts["heads"] > 0
    folder = model.save_pretrained(tmp_path / "m")
    config = json.loads((folder / ADAPTER_SUBFOLDER / ADAPTER_CONFIG_NAME).read_text())
    assert config["pal_config"]["variant"] == "lhuc"
    assert set(config["pal_parameters"]) == {f"bert.encoder.layer.{i}.pal_lhuc" for i in range(3)}
    loaded = MultiTaskBert.from_pretrained(folder)
    assert loaded.config.pal == model.config.pal and isinstance(loaded.bert.pal_variant, LHUC)
    model.eval()
    ids, mask, types = padded_batch()
    with torch.no_grad():
        assert torch.equal(loaded(ids, mask, types, TASKS).logits, model(ids, mask, types, TASKS).logits)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    adapters = model.save_pretrained(tmp_path / "a", adapters_only=True)
    fresh = MultiTaskBert(MultiTaskConfig(TINY, [get_task(t) for t in ("sst", "para", "sts")], LHUC_PAL))
    fresh.load_state_dict(model.state_dict())  # same encoder; new PAL weights come from the adapter
    with torch.no_grad():
        for layer in fresh.bert.encoder.layer:
            layer.pal_lhuc.zero_()
    fresh.load_adapter(adapters).eval()
    with torch.no_grad():
        assert torch.equal(fresh(ids, mask, types, TASKS).logits, model(ids, mask, types, TASKS).logits)


# ---------------------------------------------------------------------------------------------------------------
# The built-in variants and the typed PAL op options
# ---------------------------------------------------------------------------------------------------------------
def test_builtin_registry():
    kinds = {"parallel": Parallel, "top": Top, "top_parallel": TopParallel, "embert": EmBERT, "none": NoPAL}
    assert list(PAL_VARIANTS)[:5] == list(kinds)
    for name, cls in kinds.items():
        variant = PALConfig(variant=name).pal_variant
        assert type(variant) is cls and variant.name == name
        assert variant.injectable == variant.supports_peft == (name == "parallel")
        assert variant.task_specific == (name != "none")
    assert PALConfig(variant="top_parallel").layer_indices(4) == [0, 1, 2, 3]
    assert PALConfig(variant="top", layers=99).layer_indices(4) == []
    with pytest.raises(ValueError, match="built-in"):
        unregister_pal_variant("parallel")
    with pytest.raises(ValueError, match="already registered"):
        register_pal_variant(Parallel(), replace=True)


def test_pal_weights_are_what_the_layer_hands_to_the_op():
    torch.manual_seed(0)
    model = BertModel(TINY, pal=PALConfig(num_tasks=3, hidden=12, num_heads=2, gelu=False, dropout=0.25))
    layer = model.encoder.layer[1].pal
    w = layer.weights()
    assert isinstance(w, PALWeights) and w.num_tasks == 3 and w.num_heads == 2 and w.gelu is False
    assert w.dropout_p == 0.25 and w.enc_weight is model.pal_projections.enc_weight
    assert w.qkv_weight is layer.qkv_weight
    assert layer.eval().weights().dropout_p == 0.0
    with pytest.raises(AttributeError):
        w.num_heads = 3  # frozen
    h = torch.randn(5, 9, 32)
    mask = torch.ones(5, 9, dtype=torch.bool)
    with torch.no_grad():
        want = pal_reference(h, mask, *layer.weights().as_args(TASKS))
        got = layer(h, make_layout(mask, TASKS, False, (5, 9), 3), residual=torch.zeros_like(h))
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("variant", ["top", "top_parallel"])
@pytest.mark.parametrize("tasks", [[0, 0, 1, 2, 2], [2, 0, 1, 0, 2]], ids=["grouped", "ungrouped"])
def test_top_blocks_run_packed_rows_as_padded(variant, tasks):
    """The top blocks on packed rows (per-task GEMMs on task segments when rows are grouped, varlen attention)
    equal them on the padded batch, forward and backward; a padded batch with unpad=True runs them packed."""
    pal = PALConfig(num_tasks=3, hidden=12, num_heads=2, top_blocks=2, top_heads=3, variant=variant)
    torch.manual_seed(0)
    model = BertModel(TINY, pal=pal).eval()
    ids, mask, types = padded_batch()
    task_ids = torch.tensor(tasks)
    valid = mask.bool()
    padded = model(ids, mask, types, task_ids).last_hidden_state
    layout = BatchLayout.from_lengths(mask.sum(1).tolist(), tasks, 3)
    packed = model(ids[valid], None, types[valid], layout=layout).last_hidden_state
    assert (packed - padded[valid]).abs().max() <= 1e-5
    unpadded = model(ids, mask, types, task_ids, unpad=True).last_hidden_state
    # unpad=True: the top runs on the packed rows too (its attention on CPU: the compiled kernel or the padded
    # reference, equal within fp32 rounding)
    assert (unpadded[valid] - packed).abs().max() <= 1e-5
    w = torch.randn(packed.shape, generator=torch.Generator().manual_seed(1))
    top = [p for n, p in model.named_parameters() if n.startswith("pal_top")]
    want = torch.autograd.grad((padded[valid] * w).sum(), top)
    got = torch.autograd.grad((packed * w).sum(), top)
    for g, r in zip(got, want):
        assert (g - r).abs().max() <= 1e-5 * max(float(r.abs().max()), 1.0)
