"""megakern.models.hf against transformers, on CPU with tiny random models built offline: logits parity (fp32,
max |difference| <= 1e-4) for GPT-2, Llama (GQA, Llama-3 rope_scaling, tied embeddings), Mistral, Qwen2 (qkv
biases), GPT-NeoX and Mixtral (the cases of hf_cases.py); greedy generation equal to transformers'; import -> export
-> import bit-exact; an export transformers loads and generates the same greedy tokens from; sharded checkpoints; bad
input (truncated file, unknown architecture, misshapen / missing / extra tensors, unsupported fields, a non-empty
target) named, nothing written."""
import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[hf]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install '.[hf]')")

from megakern.models import hf  # noqa: E402

from hf_cases import CASES, V, edit_config as _edit_config, ids as _ids, saved as _saved  # noqa: E402


@pytest.mark.parametrize("name", list(CASES))
def test_import_logits_match_transformers(tmp_path, name):
    ref_model, path = _saved(tmp_path, name)
    model, config = hf.load(path)
    model.eval()
    idx = _ids()
    with torch.no_grad():
        want = ref_model(idx).logits
        got = model(idx)[..., :V]
    assert config.vocab_size == V and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generation_matches_transformers(tmp_path, name):
    """megakern's generation (KV cache) from an imported model, greedy, gives transformers' greedy tokens."""
    ref_model, path = _saved(tmp_path, name)
    model, _ = hf.load(path)
    idx = _ids(4, (2, 7))
    with torch.no_grad():
        want = ref_model.generate(idx, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                  attention_mask=torch.ones_like(idx))
    assert torch.equal(model.generate(idx, 12, temperature=0), want)


@pytest.mark.parametrize("name", list(CASES))
def test_export_round_trip_and_transformers_generation(tmp_path, name):
    ref_model, path = _saved(tmp_path, name)
    model, config = hf.load(path)
    out = hf.save(model, tmp_path / "export")
    again, config2 = hf.load(out)
    assert config2 == config
    for (k, a), (k2, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k  # bit-exact
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = AutoModelForCausalLM.from_pretrained(out).eval()
    # the family megakern's config matches (a Mistral without a sliding window is written as the Llama it equals)
    assert type(exported).__name__ == hf.ARCHITECTURES[hf.family_of(config)]
    idx = _ids(2, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(exported(idx).logits, ref_model(idx).logits, rtol=0, atol=1e-5)
        greedy = exported.generate(idx, max_new_tokens=8, do_sample=False, pad_token_id=0)
        want = ref_model.generate(idx, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(greedy, want)
    exported_files = {p.name for p in out.iterdir()}
    assert exported_files == {"config.json", "model.safetensors"}, exported_files


def test_sharded_export_and_import(tmp_path):
    _, path = _saved(tmp_path, "llama-gqa")
    model, _ = hf.load(path)
    out = hf.save(model, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((out / hf.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 2
    again, _ = hf.load(out)
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_bf16_load_and_save(tmp_path):
    _, path = _saved(tmp_path, "gpt2")
    model, _ = hf.load(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    out = hf.save(model, tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


# ---- bad input ---------------------------------------------------------------------------------------------------
def test_truncated_safetensors_named(tmp_path):
    _, path = _saved(tmp_path, "llama-gqa")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        hf.load(path)
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        hf.read_state(path, lazy=True)  # memory-mapped: the header's sizes against the file's, at open


@pytest.mark.parametrize("name", list(CASES))
def test_lazy_state_equals_the_read_one_and_reads_a_block_at_a_time(tmp_path, name, monkeypatch):
    """read_state(lazy=True), what a run's ranks start from: the same names, order, shapes and tensors as the state
    read whole; reading a block's tensor reads that block's checkpoint tensors only, and keeps one block made."""
    _, path = _saved(tmp_path, name)
    want, config = hf.read_state(path)
    reads = []
    original = hf._MappedTensors.__getitem__

    def counting(self, key):
        reads.append(key)
        return original(self, key)

    monkeypatch.setattr(hf._MappedTensors, "__getitem__", counting)
    lazy, lazy_config = hf.read_state(path, lazy=True)
    assert lazy_config == config and not reads  # checked (names, shapes) without reading a tensor
    assert list(lazy) == list(want) and len(lazy) == len(want)
    assert all(lazy.shapes[k] == tuple(t.shape) for k, t in want.items())
    block1 = [k for k in want if k.startswith("blocks.1.")]
    for key in block1:
        assert torch.equal(lazy[key], want[key]) and lazy[key].is_contiguous()
    layer = "h.1." if name == "gpt2" else "layers.1."
    assert reads and all(layer in r for r in reads), reads  # block 1's tensors alone
    reads.clear()
    assert all(torch.equal(lazy[k], t) for k, t in want.items())
    assert len(reads) < 3 * len(want)  # each group made once in order, not once per tensor


@pytest.mark.parametrize("name,changes,message", [
    ("llama-gqa", dict(architectures=["FalconForCausalLM"]),
     r"architectures \['FalconForCausalLM'\] is not one megakern imports"),
    ("llama-gqa", dict(attention_bias=True), "attention_bias true: megakern's llama layers have no biases"),
    ("llama-gqa", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("llama-gqa", dict(head_dim=32), "head_dim 32 x num_attention_heads 4 != hidden_size 64"),
    ("llama-gqa", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    ("neox-parallel", dict(hidden_act="relu"), "hidden_act 'relu': megakern's GPT-NeoX MLP is a GELU"),
    ("neox-parallel", dict(attention_bias=False), "attention_bias false"),
    ("neox-parallel", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}),
     "rotary_pct 0.1 of head dim 16 rotates 1 features"),
    ("neox-parallel", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                                            "partial_rotary_factor": 0.25}), "rope_scaling"),
    ("mixtral", dict(num_experts_per_tok=5), r"num_experts_per_tok 5 must be an int in 1\.\.num_local_experts \(4\)"),
    ("mixtral", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("mixtral", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
     "partial_rotary_factor 0.5"),
])
def test_unsupported_config_named(tmp_path, name, changes, message):
    _, path = _saved(tmp_path, name)
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=message) as info:
        hf.load(path)
    assert "config.json" in str(info.value)


def test_misshapen_missing_and_extra_tensors_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = _saved(tmp_path, "llama-gqa")
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    name = "model.layers.1.mlp.up_proj.weight"
    bad = dict(tensors)
    bad[name] = torch.zeros(97, 64)
    save_file(bad, str(f))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor model\.layers\.1\.mlp\.up_proj\.weight has "
                                         r"shape \(97, 64\); config\.json asks for \(96, 64\)"):
        hf.load(path)
    missing = {k: v for k, v in tensors.items() if k != name}
    save_file(missing, str(f))
    with pytest.raises(ValueError, match="lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        hf.load(path)
    save_file({**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, str(f))
    with pytest.raises(ValueError, match=r"tensors megakern does not use: \['model\.layers\.0\.self_attn\.q_norm"):
        hf.load(path)


def test_vocab_and_context_from_config(tmp_path):
    """A Mistral sliding window shorter than the context becomes max_seqlen; the padded vocabulary rows are 0."""
    _, path = _saved(tmp_path, "mistral")
    _edit_config(path, sliding_window=64)
    model, config = hf.load(path)
    assert config.max_seqlen == 64 and config.padded_vocab > V
    assert not model.wte.weight[V:].any()


def test_save_refuses_a_non_empty_target_and_leaves_nothing(tmp_path):
    _, path = _saved(tmp_path, "gpt2")
    model, _ = hf.load(path)
    target = tmp_path / "taken"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an empty directory; nothing written"):
        hf.save(model, target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    with pytest.raises(ValueError, match="cannot be written as llama"):
        hf.save(model, tmp_path / "wrong", family="llama")
    assert not (tmp_path / "wrong").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left


# ---- starting a (parallel) run from an imported checkpoint ----------------------------------------------------------
def test_model_init_from_config_keys(tmp_path):
    """model.init_from=hf:DIR takes the architecture from config.json; model keys beside it override its fields; a
    preset with it, a path without 'hf:', or a missing directory is a ConfigError naming it."""
    from megakern.config import ConfigError, load_config

    _, path = _saved(tmp_path, "llama-gqa")
    config = load_config(None, [f"model.init_from=hf:{path}", "model.dropout=0.1"])
    assert (config.model.n_layer, config.model.n_kv_head, config.model.vocab_size) == (2, 2, V)
    assert config.model.dropout == 0.1 and config.model.init_from == f"hf:{path}"
    with pytest.raises(ConfigError, match="model.preset 'gpt-tiny' and model.init_from"):
        load_config(None, ["model.preset=gpt-tiny", f"model.init_from=hf:{path}"])
    with pytest.raises(ConfigError, match="expected 'hf:DIR'"):
        load_config(None, [f"model.init_from={path}"])
    with pytest.raises(ConfigError, match=r"nowhere/config\.json: not found"):
        load_config(None, [f"model.init_from=hf:{tmp_path / 'nowhere'}"])


def test_trainer_starts_from_the_checkpoint(tmp_path):
    """megakern-train with model.init_from=hf:DIR (the default byte corpus: 257 ids within the model's 300): the
    model it builds holds the checkpoint's weights (lr 0: one step changes nothing), and says where they came from."""
    from megakern.config import load_config
    from megakern.train import Trainer

    _, path = _saved(tmp_path, "llama-gqa")
    config = load_config(None, [f"model.init_from=hf:{path}", "train.device=cpu", "train.steps=1",
                                "train.micro_batch_size=2", "optim.lr=1e-30", "schedule.min_lr=0", "log.progress=false",
                                "log.tensorboard=false", "train.sample_tokens=0", "data.num_workers=0",
                                "eval.every=0", "checkpoint.final=false", f"log.run_dir={tmp_path / 'run'}"])
    console = tmp_path / "console.txt"
    trainer = Trainer(config, stream=open(console, "a"))
    trainer.run()
    want, _ = hf.read_state(path)
    got = trainer.stepper.model.state_dict()
    for name, t in want.items():
        rows = V if name in ("wte.weight", "lm_head.weight") else t.shape[0]  # the padded vocabulary rows train too
        assert torch.equal(got[name][:rows].to(t.dtype), t[:rows]), name
    assert f"model: initialized from hf:{path}" in console.read_text()


def test_exported_config_shares_no_dict_with_the_model_config():
    """transformers' configs edit the rope_scaling dict they are given (adding rope_theta): neither the exported
    config.json dict nor a preset's config may share one with megakern's presets."""
    from megakern.models.gpt import PRESETS, GPTConfig

    config = GPTConfig.preset("llama-1b")
    assert config.rope_scaling == PRESETS["llama-1b"]["rope_scaling"]
    assert config.rope_scaling is not PRESETS["llama-1b"]["rope_scaling"]
    fields = hf.config_to_hf(config, "llama", torch.float32)
    fields["rope_scaling"]["rope_theta"] = 1.0
    assert "rope_theta" not in config.rope_scaling and "rope_theta" not in PRESETS["llama-1b"]["rope_scaling"]
