"""Tiny random transformers models of every family megakern.models.hf reads, built offline and saved as Hugging Face
checkpoints: the cases the import / export tests run over (test_hf.py: every family; test_hf_neox_mixtral.py: what
GPT-NeoX and Mixtral add)."""
import json
import warnings

import torch

V = 300

CASES = {
    "gpt2": ("gpt2", {}),
    "llama-gqa": ("llama", {}),
    "llama3-tied-mqa": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=500000.0,
                                      max_position_embeddings=256,
                                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
    "neox-parallel": ("gpt_neox", dict(rotary_pct=0.25)),
    "neox-sequential": ("gpt_neox", dict(rotary_pct=1.0, use_parallel_residual=False, rotary_emb_base=500.0)),
    "neox-tanh-tied": ("gpt_neox", dict(rotary_pct=0.5, hidden_act="gelu_new", tie_word_embeddings=True)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-top1-mqa": ("mixtral", dict(num_local_experts=3, num_experts_per_tok=1, num_key_value_heads=1,
                                         rope_theta=10000.0, router_jitter_noise=0.1)),
}


def hf_model(family: str, **kw):
    import transformers
    from transformers import (GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)

    transformers.logging.set_verbosity_error()
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=96,
                                          bos_token_id=0, eos_token_id=0, **kw))
    base = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                bos_token_id=0, eos_token_id=0)
    if family == "gpt_neox":
        return GPTNeoXForCausalLM(GPTNeoXConfig(**base, intermediate_size=96, **kw))
    if family == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**{**base, "intermediate_size": 48, "num_key_value_heads": 2,
                                                   "rms_norm_eps": 1e-5, **kw}))
    common = {**base, "intermediate_size": 96, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, **kw}
    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig), "mistral": (MistralForCausalLM, MistralConfig),
                "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[family]
    return cls(cfg(**common))


def saved(tmp_path, name, seed=0):
    """(the transformers model of case ``name``, the directory it was saved to); its weights moved off their initial
    values (norms, biases, routers)."""
    family, kw = CASES[name]
    torch.manual_seed(seed)
    model = hf_model(family, **kw).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path / name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path)
    return model, path


def ids(seed=1, shape=(2, 37)):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def edit_config(path, drop=(), **changes):
    """Rewrites the checkpoint's config.json: keys in ``drop`` removed, ``changes`` set."""
    cfg = json.loads((path / "config.json").read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
