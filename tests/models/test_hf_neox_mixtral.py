"""megakern.models.hf for GPT-NeoX and Mixtral against transformers, on CPU with tiny random models built offline:
the configs' fields (GPT-NeoX with parallel and sequential residual, rotary_pct 0.25, 0.5 and 1.0, the erf and the
tanh GELU; Mixtral top-2 of 4 and top-1 of 3 experts; their logits, generation and round trips run in test_hf.py over
hf_cases.py); the published configs' keys (rotary_pct,
rotary_emb_base), transformers' in-memory tensor names (fused experts, lm_head) and GPT-NeoX's old buffers read;
unsupported fields named on export (on import: test_hf.py's cases)."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[hf]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install '.[hf]')")

from megakern.models import hf  # noqa: E402
from megakern.models.gpt import GPTConfig  # noqa: E402

from hf_cases import CASES, V, edit_config as _edit_config, saved as _saved  # noqa: E402

NEOX_MIXTRAL = [name for name, (family, _) in CASES.items() if family in ("gpt_neox", "mixtral")]


@pytest.mark.parametrize("name", NEOX_MIXTRAL)
def test_config_fields_of_the_import(tmp_path, name):
    """What GPT-NeoX and Mixtral configs become (their logits, generation and round trips: test_hf.py's cases)."""
    family, kw = CASES[name]
    _, path = _saved(tmp_path, name)
    config = hf.read_config(path)
    if family == "gpt_neox":
        assert config.parallel_residual == kw.get("use_parallel_residual", True)
        assert config.rotary_pct == kw["rotary_pct"]
        assert config.activation == ("gelu" if kw.get("hidden_act") == "gelu_new" else "gelu_exact")
    else:
        assert (config.n_experts, config.moe_top_k) == (kw["num_local_experts"], kw["num_experts_per_tok"])
        assert config.moe_renormalize and config.moe_router == "softmax" and config.moe_capacity_factor is None


def test_exported_tensor_names_are_the_published_ones(tmp_path):
    """The files hold what save_pretrained writes (and published checkpoints use): per-expert w1 / w2 / w3 under
    block_sparse_moe, GPT-NeoX's embed_out."""
    from safetensors.torch import load_file

    for name in ("mixtral", "neox-parallel"):
        _, path = _saved(tmp_path, name)
        model, _ = hf.load(path)
        out = hf.save(model, tmp_path / f"{name}-export")
        assert set(load_file(str(out / hf.SINGLE))) == set(load_file(str(path / hf.SINGLE)))
    names = set(load_file(str(out / hf.SINGLE)))
    assert "embed_out.weight" in names and "gpt_neox.layers.1.attention.query_key_value.weight" in names
    mixtral = set(load_file(str(tmp_path / "mixtral-export" / hf.SINGLE)))
    assert {f"model.layers.1.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w2", "w3")} <= mixtral


def test_in_memory_names_and_old_buffers_read(tmp_path):
    """A state dict saved as transformers' modules hold it (Mixtral's fused gate_up_proj / down_proj and mlp.gate,
    GPT-NeoX's lm_head) gives the same model; GPT-NeoX's old causal-mask and rotary buffers are skipped."""
    from safetensors.torch import load_file, save_file

    for name in ("mixtral", "neox-parallel"):
        ref_model, path = _saved(tmp_path, name)
        want, _ = hf.read_state(path)
        memory = {k: v.contiguous() for k, v in ref_model.state_dict().items()}
        assert any(k.endswith(("experts.gate_up_proj", "lm_head.weight")) for k in memory)
        save_file(memory, str(path / hf.SINGLE))
        got, _ = hf.read_state(path)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name
    tensors = load_file(str(path / hf.SINGLE))
    tensors["gpt_neox.layers.0.attention.bias"] = torch.ones(1, 1, 128, 128, dtype=torch.bool)
    tensors["gpt_neox.layers.0.attention.masked_bias"] = torch.tensor(-1e9)
    tensors["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(2)
    save_file(tensors, str(path / hf.SINGLE))
    assert all(torch.equal(want[k], t) for k, t in hf.read_state(path)[0].items())


def test_published_neox_config_keys(tmp_path):
    """Published GPT-NeoX configs (Pythia) give the rotation as rotary_pct / rotary_emb_base, transformers 5 as
    rope_parameters: the same config either way."""
    _, path = _saved(tmp_path, "neox-sequential")
    config = hf.read_config(path)
    _edit_config(path, drop=("rope_parameters",), rotary_pct=1.0, rotary_emb_base=500.0)
    assert hf.read_config(path) == config
    _edit_config(path, rotary_pct=0.5, rotary_emb_base=20.0)
    assert (hf.read_config(path).rotary_pct, hf.read_config(path).rotary_base) == (0.5, 20.0)


def test_mixtral_sliding_window_and_aux_coefficient(tmp_path):
    _, path = _saved(tmp_path, "mixtral")
    _edit_config(path, sliding_window=64, router_aux_loss_coef=0.02)
    config = hf.read_config(path)
    assert config.max_seqlen == 64 and config.moe_aux_loss_coef == 0.02


def test_misshapen_and_missing_expert_tensors_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = _saved(tmp_path, "mixtral")
    f = path / hf.SINGLE
    tensors = load_file(str(f))
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    save_file({**tensors, name: torch.zeros(47, 64)}, str(f))
    with pytest.raises(ValueError, match=rf"tensor {name} has shape \(47, 64\); config\.json asks for \(48, 64\)"):
        hf.load(path)
    save_file({k: v for k, v in tensors.items() if k != name}, str(f))
    with pytest.raises(ValueError, match=f"lacks tensor '{name}'"):
        hf.load(path)


MIXTRAL_LIKE = dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, vocab_size=V, norm="rmsnorm", position="rotary",
                    activation="swiglu", bias=False, n_experts=4, moe_top_k=2, moe_ffn_hidden=48,
                    moe_renormalize=True)
NEOX_LIKE = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=V, norm="layernorm", position="rotary",
                 rotary_pct=0.25, activation="gelu_exact", bias=True, parallel_residual=True)


@pytest.mark.parametrize("fields,message", [
    (dict(MIXTRAL_LIKE, moe_renormalize=False), "moe_renormalize false: Mixtral renormalizes"),
    (dict(MIXTRAL_LIKE, moe_first_dense=1), "moe_first_dense=1: every Mixtral block is MoE"),
    (dict(MIXTRAL_LIKE, moe_shared_experts=1), "moe_shared_experts=1"),
    (dict(MIXTRAL_LIKE, moe_router="sigmoid"), "moe_router='sigmoid'"),
    (dict(MIXTRAL_LIKE, activation="gelu"), "the Mixture-of-Experts family megakern writes is Mixtral"),
    (dict(NEOX_LIKE, n_kv_head=2), "GPT-NeoX has no grouped-query attention"),
    (dict(NEOX_LIKE, position="learned"), "parallel_residual true: the family megakern writes with it is GPT-NeoX"),
    (dict(MIXTRAL_LIKE, n_experts=0, parallel_residual=True), "parallel_residual true"),
    (dict(NEOX_LIKE, position="learned", parallel_residual=False), "is none of GPT-2"),
])
def test_export_refuses_what_the_family_lacks(tmp_path, fields, message):
    config = GPTConfig(**fields).validate()
    with pytest.raises(ValueError, match=message):
        hf.family_of(config)
    from megakern.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(config)
    with pytest.raises(ValueError, match=message):
        hf.save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_families_of_megakern_configs():
    assert hf.family_of(GPTConfig(**NEOX_LIKE)) == "gpt_neox"
    assert hf.family_of(GPTConfig(**dict(NEOX_LIKE, activation="gelu", parallel_residual=False))) == "gpt_neox"
    assert hf.family_of(GPTConfig(**MIXTRAL_LIKE)) == "mixtral"
    assert hf.family_of(GPTConfig.preset("moe-mixtral")) == "mixtral"
    with pytest.raises(ValueError, match="moe_first_dense=1"):
        hf.family_of(GPTConfig.preset("moe-tiny"))
