"""Hugging Face checkpoints to and from megakern GPTs: ``load(path) -> (model, config)`` and ``save(model, dir)``.

A Hugging Face checkpoint is a directory with config.json and safetensors weights (one model.safetensors, or shards
named by model.safetensors.index.json); they are read and written with the ``safetensors`` library, never pickles.

Families (config.json's ``architectures``):

| architecture | megakern GPT |
|---|---|
| GPT2LMHeadModel | LayerNorm, learned positions, GELU (tanh), biases, tied embeddings |
| LlamaForCausalLM, MistralForCausalLM | RMSNorm, RoPE (rotate-half, rope_theta, Llama-3 rope_scaling), SwiGLU, |
| | grouped-query attention, no biases |
| Qwen2ForCausalLM | as Llama, with biases in q, k and v (``qkv_bias``) |
| GPTNeoXForCausalLM | LayerNorm, partial RoPE (rotary_pct: the first features of each head, rotate-half), GELU |
| | (erf: ``activation="gelu_exact"``; or the tanh form), biases, parallel residual (``parallel_residual``) or |
| | sequential, untied embed_out |
| MixtralForCausalLM | as Mistral, every MLP a Mixture of Experts: softmax router, top-k renormalized |
| | (``moe_renormalize``), SwiGLU experts, dropless |

Weights are rearranged, not recomputed: GPT-2's Conv1D weights are transposed; q, k and v (GPT-2's fused c_attn, or
Llama's q_proj / k_proj / v_proj) become megakern's qkv, whose rows are grouped per key/value head ([the g query
heads it serves, its k head, its v head]); GPT-NeoX's query_key_value, rows (nh, 3, hs) per head, is that layout
already; Llama's gate_proj and up_proj become megakern's fc with interleaved rows (2i the gate of unit i, 2i + 1 its
up projection); Mixtral's experts.E.w1 / w3 (gate / up) become column pairs of w_in[E] (C, 2F) the same way,
w_out[E] (F, C) is w2 transposed, the gate is the router's weight; the embedding gets megakern's padded vocabulary
(rows past the tokenizer's zero on import, dropped on export). Import then export gives the same tensors, bit for
bit.
Besides the names save_pretrained writes, the names of transformers' modules are read too (a state dict saved as
the model holds it): GPT-NeoX's lm_head.weight for embed_out.weight, Mixtral's fused mlp.experts.gate_up_proj
(E, 2F, C: the F gate rows, then the F up rows) and down_proj (E, C, F) and mlp.gate.weight.

What a checkpoint uses that megakern lacks is a ValueError naming the file and the field (an unknown architecture,
attention or MLP biases in a Llama, a GPT-NeoX without attention biases, a head dim other than hidden / heads, an
activation other than the family's, a rope_scaling type megakern does not implement, a rotary_pct that rotates an odd
number of features); a missing, extra or misshapen tensor names the tensor, the file and both shapes; a truncated or
corrupt safetensors file names the file. ``save`` writes into a temporary directory beside the target and renames
it into place: an export that fails leaves nothing behind.

A Mistral or Mixtral ``sliding_window`` shorter than ``max_position_embeddings`` becomes the model's max_seqlen:
within it the attention is the same (megakern attends to the whole context).

Mixtral's router is megakern's softmax router with ``moe_renormalize`` (softmax over all experts in fp32, the top k,
their weights renormalized to sum 1), dropless (``moe_capacity_factor`` None); megakern computes the router's logits
in fp32 too, transformers in the model's dtype (the same in fp32). ``router_aux_loss_coef`` becomes
``moe_aux_loss_coef`` as it is (megakern adds each MoE layer's Switch loss; transformers' loss, when asked for with
output_router_logits, is k times it and averaged over the layers); ``router_jitter_noise``, a training-time input
noise of transformers, is not applied by megakern (inference is the same; a fine-tuning run has no jitter).

The logits of the tokenizer's ids equal transformers'. An imported model's config has ``mask_padded_vocab``: its
loss leaves out the padded vocabulary's columns (rows past vocab_size, zero on import), so it is transformers' loss
also where vocab_size is not a multiple of 128 (GPT-2's 50257); sampling reads the real vocabulary only.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import torch

from megakern.models.gpt import GPT, GPTConfig

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FAMILIES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2", "GPTNeoXForCausalLM": "gpt_neox", "MixtralForCausalLM": "mixtral"}
ARCHITECTURES = {family: arch for arch, family in FAMILIES.items()}
# GPT-NeoX's hidden_act -> megakern's activation
NEOX_ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}
MAX_SHARD_BYTES = 5 * 2**30


# ---- configs ---------------------------------------------------------------------------------------------------
def _need(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {message}")


def _rope_scaling(hf: dict, params: dict) -> dict | None:
    """The rope_scaling dict of a config (its rope_scaling, or transformers 5's rope_parameters less the base and the
    rotary fraction); None for the plain rotation."""
    scaling = hf.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return None
    return scaling


def _validated(config: GPTConfig, family: str, where: str) -> tuple[GPTConfig, str]:
    """The checked config; its loss leaves out the padded vocabulary (transformers' loss over the real one)."""
    config.mask_padded_vocab = True
    try:
        return config.validate(), family
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def config_from_hf(hf: dict, where: str = CONFIG) -> tuple[GPTConfig, str]:
    """(megakern GPTConfig, family) of a Hugging Face config dict; ValueError naming what megakern lacks."""
    archs = hf.get("architectures") or []
    family = next((FAMILIES[a] for a in archs if a in FAMILIES), None)
    _need(family is not None, where, f"architectures {archs} is not one megakern imports (known: {sorted(FAMILIES)})")
    if family == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        _need(act in ("gelu_new", "gelu_pytorch_tanh"), where,
              f"activation_function {act!r}: megakern's GPT-2 MLP is the tanh GELU (gelu_new)")
        _need(hf.get("scale_attn_weights", True), where, "scale_attn_weights false: megakern scales by 1/sqrt(hs)")
        _need(not hf.get("scale_attn_by_inverse_layer_idx", False), where,
              "scale_attn_by_inverse_layer_idx true is not implemented")
        c = hf["n_embd"]
        config = GPTConfig(n_layer=hf["n_layer"], n_embd=c, n_head=hf["n_head"], ffn_hidden=hf.get("n_inner") or 4 * c,
                           vocab_size=hf["vocab_size"], max_seqlen=hf["n_positions"], norm="layernorm",
                           norm_eps=hf.get("layer_norm_epsilon", 1e-5), position="learned", activation="gelu",
                           bias=True, tie_embeddings=hf.get("tie_word_embeddings", True), dropout=0.0)
        return _validated(config, family, where)
    c, nh = hf["hidden_size"], hf["num_attention_heads"]
    params = hf.get("rope_parameters") or {}
    if family == "gpt_neox":
        act = hf.get("hidden_act", "gelu")
        _need(act in NEOX_ACTIVATIONS, where, f"hidden_act {act!r}: megakern's GPT-NeoX MLP is a GELU, one of "
                                              f"{sorted(NEOX_ACTIVATIONS)} ('gelu' the erf form)")
        _need(hf.get("attention_bias", True), where, "attention_bias false: megakern's attention projections have "
                                                     "biases when its MLP and LayerNorms do (bias)")
        # transformers 5's rope_parameters first (as it reads them), then the published configs' keys
        theta = params.get("rope_theta", hf.get("rotary_emb_base", 10000.0))
        pct = params.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))
        _need(isinstance(pct, (int, float)) and not isinstance(pct, bool) and 0 < pct <= 1, where,
              f"rotary_pct {pct!r} must be in (0, 1]")
        if c % nh == 0:
            rotated = int(c // nh * pct)  # transformers' rotary_ndims
            _need(rotated >= 2 and rotated % 2 == 0, where,
                  f"rotary_pct {pct} of head dim {c // nh} rotates {rotated} features: megakern rotates pairs (an "
                  "even number, at least 2)")
        config = GPTConfig(n_layer=hf["num_hidden_layers"], n_embd=c, n_head=nh, ffn_hidden=hf["intermediate_size"],
                           vocab_size=hf["vocab_size"], max_seqlen=hf.get("max_position_embeddings", 2048),
                           norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-5), position="rotary",
                           rotary_pct=float(pct), rotary_base=float(theta), rope_scaling=_rope_scaling(hf, params),
                           activation=NEOX_ACTIVATIONS[act], bias=True,
                           parallel_residual=bool(hf.get("use_parallel_residual", True)),
                           tie_embeddings=hf.get("tie_word_embeddings", False), dropout=0.0)
        return _validated(config, family, where)
    # llama / mistral / qwen2 / mixtral
    _need(hf.get("hidden_act", "silu") == "silu", where, f"hidden_act {hf.get('hidden_act')!r}: megakern's SwiGLU "
                                                          "gates with silu")
    for key in ("attention_bias", "mlp_bias"):
        _need(not hf.get(key, False), where, f"{key} true: megakern's {family} layers have no biases")
    head_dim = hf.get("head_dim") or c // nh
    _need(head_dim * nh == c, where, f"head_dim {head_dim} x num_attention_heads {nh} != hidden_size {c}: megakern's "
                                     "head dim is hidden_size / heads")
    pct = params.get("partial_rotary_factor", 1.0)
    _need(pct == 1, where, f"rope_parameters' partial_rotary_factor {pct}: megakern's {family} rotates the whole head")
    theta = hf.get("rope_theta", params.get("rope_theta", 1e6 if family == "mixtral" else 10000.0))
    max_seqlen = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window") if family in ("mistral", "mixtral") else None
    if family == "qwen2" and hf.get("use_sliding_window", False):
        window = hf.get("sliding_window")
        _need(hf.get("max_window_layers", 0) >= hf["num_hidden_layers"] or window is None or window >= max_seqlen,
              where, f"use_sliding_window with sliding_window {window} below max_position_embeddings {max_seqlen} "
                     "in some layers (max_window_layers): megakern attends to the whole context in every layer")
        window = None
    if window is not None and window < max_seqlen:
        max_seqlen = window
    moe = {}
    if family == "mixtral":
        e, k = hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2)
        _need(isinstance(e, int) and not isinstance(e, bool) and e >= 1, where,
              f"num_local_experts {e!r} must be an int >= 1")
        _need(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= e, where,
              f"num_experts_per_tok {k!r} must be an int in 1..num_local_experts ({e})")
        jitter = hf.get("router_jitter_noise", 0.0) or 0.0
        _need(isinstance(jitter, (int, float)) and jitter >= 0, where, f"router_jitter_noise {jitter!r} must be >= 0")
        # softmax over all experts, the top k, renormalized: megakern's softmax router with moe_renormalize; no
        # capacity (transformers' Mixtral drops nothing); router_jitter_noise (training only) is not applied
        moe = dict(n_experts=e, moe_top_k=k, moe_ffn_hidden=hf["intermediate_size"], moe_router="softmax",
                   moe_renormalize=True, moe_capacity_factor=None,
                   moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)), moe_z_loss_coef=0.0)
    config = GPTConfig(n_layer=hf["num_hidden_layers"], n_embd=c, n_head=nh,
                       n_kv_head=hf.get("num_key_value_heads") or nh, ffn_hidden=hf["intermediate_size"],
                       vocab_size=hf["vocab_size"], max_seqlen=max_seqlen, norm="rmsnorm",
                       norm_eps=hf.get("rms_norm_eps", 1e-6), position="rotary", rotary_base=float(theta),
                       rope_scaling=_rope_scaling(hf, params), activation="swiglu", bias=False,
                       qkv_bias=family == "qwen2" or None, tie_embeddings=hf.get("tie_word_embeddings", False),
                       dropout=0.0, **moe)
    return _validated(config, family, where)


def _copied(scaling: dict | None) -> dict | None:
    """A copy of a config's rope_scaling: transformers' configs edit the dict they are given (adding rope_theta)."""
    return None if scaling is None else dict(scaling)


def config_to_hf(config: GPTConfig, family: str, dtype: torch.dtype) -> dict:
    """The config.json of ``config`` as a ``family`` model."""
    dtype_name = str(dtype).removeprefix("torch.")
    if family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": config.n_layer,
                "n_embd": config.n_embd, "n_head": config.n_head, "n_inner": config.ffn_hidden,
                "n_positions": config.max_seqlen, "n_ctx": config.max_seqlen, "vocab_size": config.vocab_size,
                "layer_norm_epsilon": config.norm_eps, "activation_function": "gelu_new",
                "tie_word_embeddings": config.tie_embeddings, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attn_pdrop": 0.0, "scale_attn_weights": True, "torch_dtype": dtype_name, "dtype": dtype_name}
    if family == "gpt_neox":  # the keys of the published GPT-NeoX / Pythia configs
        return {"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
                "num_hidden_layers": config.n_layer, "hidden_size": config.n_embd,
                "num_attention_heads": config.n_head, "intermediate_size": config.ffn_hidden,
                "vocab_size": config.vocab_size, "max_position_embeddings": config.max_seqlen,
                "layer_norm_eps": config.norm_eps,
                "hidden_act": "gelu" if config.activation == "gelu_exact" else "gelu_new",
                "rotary_pct": config.rotary_pct, "rotary_emb_base": config.rotary_base,
                "rope_scaling": _copied(config.rope_scaling), "use_parallel_residual": config.parallel_residual,
                "attention_bias": True, "tie_word_embeddings": config.tie_embeddings, "attention_dropout": 0.0,
                "hidden_dropout": 0.0, "torch_dtype": dtype_name, "dtype": dtype_name}
    out = {"architectures": [ARCHITECTURES[family]], "model_type": family, "num_hidden_layers": config.n_layer,
           "hidden_size": config.n_embd, "num_attention_heads": config.n_head,
           "num_key_value_heads": config.n_kv_head, "head_dim": config.head_dim,
           "intermediate_size": config.ffn_hidden, "vocab_size": config.vocab_size,
           "max_position_embeddings": config.max_seqlen, "rms_norm_eps": config.norm_eps, "hidden_act": "silu",
           "rope_theta": config.rotary_base, "rope_scaling": _copied(config.rope_scaling), "attention_bias": False,
           "mlp_bias": False, "tie_word_embeddings": config.tie_embeddings, "attention_dropout": 0.0,
           "torch_dtype": dtype_name, "dtype": dtype_name}
    if family == "mistral":
        out["sliding_window"] = None
    if family == "qwen2":
        for key in ("attention_bias", "mlp_bias", "head_dim"):
            del out[key]
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.n_layer)
    if family == "mixtral":
        for key in ("attention_bias", "mlp_bias"):
            del out[key]
        out.update(intermediate_size=config.moe_ffn_hidden, num_local_experts=config.n_experts,
                   num_experts_per_tok=config.moe_top_k, router_aux_loss_coef=config.moe_aux_loss_coef,
                   router_jitter_noise=0.0, output_router_logits=False, sliding_window=None)
    return out


def family_of(config: GPTConfig) -> str:
    """The Hugging Face family a megakern config exports as; ValueError naming what none of them has."""
    kind = (config.norm, config.position, config.activation, config.bias)
    if config.n_experts:
        _need(kind == ("rmsnorm", "rotary", "swiglu", False), "GPTConfig",
              f"n_experts={config.n_experts} with norm={config.norm}, position={config.position}, "
              f"activation={config.activation}, bias={config.bias}: the Mixture-of-Experts family megakern writes is "
              "Mixtral (rmsnorm, rotary, swiglu, no biases)")
        for ok, what in ((config.moe_every == 1 and config.moe_first_dense == 0,
                          f"moe_every={config.moe_every}, moe_first_dense={config.moe_first_dense}: every Mixtral "
                          "block is MoE"),
                         (config.moe_shared_experts == 0, f"moe_shared_experts={config.moe_shared_experts}: Mixtral "
                                                          "has no shared experts"),
                         (config.moe_router == "softmax", f"moe_router={config.moe_router!r}: Mixtral's router is "
                                                          "the softmax"),
                         (config.moe_renormalize, "moe_renormalize false: Mixtral renormalizes the top-k weights"),
                         (config.moe_n_groups == 1, f"moe_n_groups={config.moe_n_groups}: Mixtral routes without "
                                                    "groups"),
                         (not config.moe_force_balance, "moe_force_balance true: the router was bypassed in "
                                                        "training (benchmarks only)"),
                         (not config.qkv_bias, "qkv_bias true: Mixtral's q, k, v have no biases"),
                         (not config.parallel_residual, "parallel_residual true: Mixtral's blocks are sequential"),
                         (config.rotary_pct == 1.0, f"rotary_pct {config.rotary_pct}: Mixtral rotates the whole "
                                                    "head")):
            _need(ok, "GPTConfig", what)
        return "mixtral"
    if kind in (("layernorm", "rotary", "gelu", True), ("layernorm", "rotary", "gelu_exact", True)):
        _need(config.n_kv_head == config.n_head, "GPTConfig", "GPT-NeoX has no grouped-query attention "
                                                               f"(n_kv_head {config.n_kv_head} != n_head)")
        _need(config.qkv_bias in (None, True), "GPTConfig", "qkv_bias false: GPT-NeoX's query_key_value has a bias")
        return "gpt_neox"
    _need(not config.parallel_residual, "GPTConfig", "parallel_residual true: the family megakern writes with it is "
                                                     "GPT-NeoX (layernorm, rotary, gelu or gelu_exact, biases)")
    if kind == ("layernorm", "learned", "gelu", True):
        _need(config.n_kv_head == config.n_head, "GPTConfig", "GPT-2 has no grouped-query attention "
                                                               f"(n_kv_head {config.n_kv_head} != n_head)")
        _need(config.qkv_bias in (None, True), "GPTConfig", "qkv_bias false: GPT-2's c_attn has a bias")
        return "gpt2"
    if kind == ("rmsnorm", "rotary", "swiglu", False):
        _need(config.rotary_pct == 1.0, "GPTConfig", f"rotary_pct {config.rotary_pct}: Llama rotates the whole head")
        return "qwen2" if config.qkv_bias else "llama"
    raise ValueError(f"GPTConfig: norm={config.norm}, position={config.position}, activation={config.activation}, "
                     f"bias={config.bias} is none of GPT-2 (layernorm, learned, gelu, biases), GPT-NeoX (layernorm, "
                     "rotary, gelu or gelu_exact, biases), Llama (rmsnorm, rotary, swiglu, no biases)")


# ---- weights ---------------------------------------------------------------------------------------------------
def _qkv_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """megakern's qkv (rows grouped per kv head: its g query heads, its k head, its v head) from q, k, v (rows per
    head, first dim)."""
    nkv, hs = config.n_kv_head, config.head_dim
    g = config.n_head // nkv
    rest = q.shape[1:]
    parts = [q.reshape(nkv, g, hs, *rest), k.reshape(nkv, 1, hs, *rest), v.reshape(nkv, 1, hs, *rest)]
    return torch.cat(parts, dim=1).reshape(nkv * (g + 2) * hs, *rest)


def _qkv_split(qkv: torch.Tensor, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nkv, hs = config.n_kv_head, config.head_dim
    g = config.n_head // nkv
    rest = qkv.shape[1:]
    grouped = qkv.reshape(nkv, g + 2, hs, *rest)
    return (grouped[:, :g].reshape(nkv * g * hs, *rest), grouped[:, g].reshape(nkv * hs, *rest),
            grouped[:, g + 1].reshape(nkv * hs, *rest))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(2F, C) rows 2i / 2i + 1 the gate / up of unit i, from gate and up (F, C): megakern's SwiGLU layout."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], gate.shape[1])


def _deinterleave(fc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = fc.reshape(fc.shape[0] // 2, 2, fc.shape[1])
    return pairs[:, 0], pairs[:, 1]


def output_name(family: str) -> str:
    """The Hugging Face name of the untied output projection's weight."""
    return "embed_out.weight" if family == "gpt_neox" else "lm_head.weight"


# GPT-NeoX's modules of a layer -> megakern's (each with weight and bias; query_key_value's rows, (nh, 3, hs), are
# megakern's qkv layout with one query head per kv head)
NEOX_LAYER = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm"),
              ("attention.query_key_value", "attn.qkv"), ("attention.dense", "attn.proj"),
              ("mlp.dense_h_to_4h", "mlp.fc"), ("mlp.dense_4h_to_h", "mlp.proj"))


def _prefix(family: str) -> str:
    return {"gpt2": "transformer.", "gpt_neox": "gpt_neox."}.get(family, "model.")


def _head_state(take, config: GPTConfig, family: str) -> dict:
    """megakern's tensors before the blocks (the embeddings), from ``take(hf_name)``."""
    pre, V = _prefix(family), config.padded_vocab
    if family == "gpt2":
        return {"wte.weight": _pad_rows(take(pre + "wte.weight"), V), "wpe.weight": take(pre + "wpe.weight")}
    return {"wte.weight": _pad_rows(take(pre + ("embed_in.weight" if family == "gpt_neox" else "embed_tokens.weight")),
                                    V)}


def _block_state(take, config: GPTConfig, family: str, i: int) -> dict:
    """megakern's tensors of block ``i``, from ``take(hf_name)``."""
    out, pre, b = {}, _prefix(family), f"blocks.{i}."
    if family == "gpt2":
        h, c = f"{pre}h.{i}.", config.n_embd
        for src, dst in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
            out[b + dst + ".weight"], out[b + dst + ".bias"] = take(h + src + ".weight"), take(h + src + ".bias")
        w, bias = take(h + "attn.c_attn.weight").t(), take(h + "attn.c_attn.bias")  # (3C, C): q, k, v blocks
        out[b + "attn.qkv.weight"] = _qkv_rows(w[:c], w[c:2 * c], w[2 * c:], config)
        out[b + "attn.qkv.bias"] = _qkv_rows(bias[:c], bias[c:2 * c], bias[2 * c:], config)
        out[b + "attn.proj.weight"], out[b + "attn.proj.bias"] = (take(h + "attn.c_proj.weight").t(),
                                                                  take(h + "attn.c_proj.bias"))
        out[b + "mlp.fc.weight"] = take(h + "mlp.c_fc.weight").t()
        out[b + "mlp.fc.bias"] = take(h + "mlp.c_fc.bias")
        out[b + "mlp.proj.weight"], out[b + "mlp.proj.bias"] = (take(h + "mlp.c_proj.weight").t(),
                                                                take(h + "mlp.c_proj.bias"))
        return out
    h = f"{pre}layers.{i}."
    if family == "gpt_neox":
        for src, dst in NEOX_LAYER:
            for leaf in (".weight", ".bias"):
                out[b + dst + leaf] = take(h + src + leaf)
        return out
    out[b + "attn_norm.weight"] = take(h + "input_layernorm.weight")
    out[b + "mlp_norm.weight"] = take(h + "post_attention_layernorm.weight")
    out[b + "attn.qkv.weight"] = _qkv_rows(take(h + "self_attn.q_proj.weight"), take(h + "self_attn.k_proj.weight"),
                                           take(h + "self_attn.v_proj.weight"), config)
    if family == "qwen2":
        out[b + "attn.qkv.bias"] = _qkv_rows(take(h + "self_attn.q_proj.bias"), take(h + "self_attn.k_proj.bias"),
                                             take(h + "self_attn.v_proj.bias"), config)
    out[b + "attn.proj.weight"] = take(h + "self_attn.o_proj.weight")
    if family == "mixtral":  # expert e: w1 (gate), w3 (up) (F, C) -> w_in[e] (C, 2F); w2 (C, F) -> w_out[e]
        m = h + "block_sparse_moe."
        out[b + "mlp.router.weight"] = take(m + "gate.weight")
        experts = [f"{m}experts.{e}." for e in range(config.n_experts)]
        out[b + "mlp.w_in"] = torch.stack([_interleave(take(x + "w1.weight"), take(x + "w3.weight")).t()
                                           for x in experts])
        out[b + "mlp.w_out"] = torch.stack([take(x + "w2.weight").t() for x in experts])
    else:
        out[b + "mlp.fc.weight"] = _interleave(take(h + "mlp.gate_proj.weight"), take(h + "mlp.up_proj.weight"))
        out[b + "mlp.proj.weight"] = take(h + "mlp.down_proj.weight")
    return out


def _tail_state(take, config: GPTConfig, family: str) -> dict:
    """megakern's tensors after the blocks: the final norm and an untied output projection."""
    pre, out = _prefix(family), {}
    norm = {"gpt2": "ln_f", "gpt_neox": "final_layer_norm"}.get(family, "norm")
    for leaf in ((".weight", ".bias") if family in ("gpt2", "gpt_neox") else (".weight",)):
        out["norm_f" + leaf] = take(pre + norm + leaf)
    if not config.tie_embeddings:
        out["lm_head.weight"] = _pad_rows(take(output_name(family)), config.padded_vocab)
    return out


def _groups(config: GPTConfig, family: str) -> list:
    """The parts of megakern's state dict in its order: each a function of ``take``."""
    return ([lambda take: _head_state(take, config, family)]
            + [lambda take, i=i: _block_state(take, config, family, i) for i in range(config.n_layer)]
            + [lambda take: _tail_state(take, config, family)])


def state_from_hf(tensors, config: GPTConfig, family: str) -> dict:
    """megakern's state dict from a Hugging Face one (names without the files); KeyError lists the missing names."""
    out = {}
    for group in _groups(config, family):
        out.update(group(tensors.__getitem__))
    return {k: v.contiguous() for k, v in out.items()}


class LazyState(Mapping):
    """megakern's state dict of a Hugging Face checkpoint, each tensor made when it is read: the checkpoint's tensors
    come from the memory-mapped safetensors files, one block's at a time (the last block made is kept for the next
    reads). A parallel run's ranks start from it holding one block of the model in host memory, not the whole."""

    def __init__(self, tensors, shapes: dict, config: GPTConfig, family: str):
        self._tensors, self._groups = tensors, _groups(config, family)
        meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
        self._where, self.shapes = {}, {}
        for index, group in enumerate(self._groups):  # names and shapes without reading a byte: on meta tensors
            for name, t in group(meta.__getitem__).items():
                self._where[name], self.shapes[name] = index, tuple(t.shape)
        self._cached = (None, {})

    def __getitem__(self, name: str) -> torch.Tensor:
        index = self._where[name]
        if self._cached[0] != index:
            self._cached = (None, {})  # the previous group freed before the next one is made
            made = self._groups[index](self._tensors.__getitem__)
            self._cached = (index, {k: v.contiguous() for k, v in made.items()})
        return self._cached[1][name]

    def __contains__(self, name) -> bool:  # Mapping's would make the tensor's block
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def state_to_hf(state: dict, config: GPTConfig, family: str) -> dict:
    """A Hugging Face state dict (contiguous, no shared storage) from megakern's."""
    out = {}
    V = config.vocab_size
    if family == "gpt2":
        pre = "transformer."
        out[pre + "wte.weight"] = state["wte.weight"][:V]
        out[pre + "wpe.weight"] = state["wpe.weight"]
        for i in range(config.n_layer):
            h, b = f"{pre}h.{i}.", f"blocks.{i}."
            for dst, src in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
                out[h + dst + ".weight"], out[h + dst + ".bias"] = state[b + src + ".weight"], state[b + src + ".bias"]
            q, k, v = _qkv_split(state[b + "attn.qkv.weight"], config)
            out[h + "attn.c_attn.weight"] = torch.cat([q, k, v]).t()
            out[h + "attn.c_attn.bias"] = torch.cat(_qkv_split(state[b + "attn.qkv.bias"], config))
            out[h + "attn.c_proj.weight"], out[h + "attn.c_proj.bias"] = (state[b + "attn.proj.weight"].t(),
                                                                          state[b + "attn.proj.bias"])
            out[h + "mlp.c_fc.weight"] = state[b + "mlp.fc.weight"].t()
            out[h + "mlp.c_fc.bias"] = state[b + "mlp.fc.bias"]
            out[h + "mlp.c_proj.weight"], out[h + "mlp.c_proj.bias"] = (state[b + "mlp.proj.weight"].t(),
                                                                        state[b + "mlp.proj.bias"])
        out[pre + "ln_f.weight"], out[pre + "ln_f.bias"] = state["norm_f.weight"], state["norm_f.bias"]
    elif family == "gpt_neox":
        pre = "gpt_neox."
        out[pre + "embed_in.weight"] = state["wte.weight"][:V]
        for i in range(config.n_layer):
            h, b = f"{pre}layers.{i}.", f"blocks.{i}."
            for dst, src in NEOX_LAYER:
                for leaf in (".weight", ".bias"):
                    out[h + dst + leaf] = state[b + src + leaf]
        for leaf in (".weight", ".bias"):
            out[pre + "final_layer_norm" + leaf] = state["norm_f" + leaf]
    else:
        pre = "model."
        out[pre + "embed_tokens.weight"] = state["wte.weight"][:V]
        for i in range(config.n_layer):
            h, b = f"{pre}layers.{i}.", f"blocks.{i}."
            out[h + "input_layernorm.weight"] = state[b + "attn_norm.weight"]
            out[h + "post_attention_layernorm.weight"] = state[b + "mlp_norm.weight"]
            q, k, v = _qkv_split(state[b + "attn.qkv.weight"], config)
            out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"] = q, k
            out[h + "self_attn.v_proj.weight"] = v
            if family == "qwen2":
                qb, kb, vb = _qkv_split(state[b + "attn.qkv.bias"], config)
                out[h + "self_attn.q_proj.bias"], out[h + "self_attn.k_proj.bias"] = qb, kb
                out[h + "self_attn.v_proj.bias"] = vb
            out[h + "self_attn.o_proj.weight"] = state[b + "attn.proj.weight"]
            if family == "mixtral":
                m = h + "block_sparse_moe."
                out[m + "gate.weight"] = state[b + "mlp.router.weight"]
                for e, (w_in, w_out) in enumerate(zip(state[b + "mlp.w_in"], state[b + "mlp.w_out"])):
                    x = f"{m}experts.{e}."
                    out[x + "w1.weight"], out[x + "w3.weight"] = _deinterleave(w_in.t())
                    out[x + "w2.weight"] = w_out.t()
            else:
                gate, up = _deinterleave(state[b + "mlp.fc.weight"])
                out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
                out[h + "mlp.down_proj.weight"] = state[b + "mlp.proj.weight"]
        out[pre + "norm.weight"] = state["norm_f.weight"]
    if not config.tie_embeddings:
        out[output_name(family)] = state["lm_head.weight"][:V]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def _file_names(tensors: dict, where: dict, config: GPTConfig, family: str, root: Path) -> None:
    """Renames, in place, tensors under transformers' module names (a state dict saved as the model holds it) to the
    names save_pretrained writes: GPT-NeoX's lm_head (embed_out); Mixtral's mlp.gate and fused experts,
    gate_up_proj (E, 2F, C: gate rows, then up rows) and down_proj (E, C, F), to block_sparse_moe's per-expert
    w1 / w3 / w2."""
    def rename(old, new):
        if isinstance(tensors, _MappedTensors):
            tensors.rename(old, new)  # not read
        else:
            tensors[new] = tensors.pop(old)
        where[new] = where.pop(old)

    if family == "gpt_neox" and "lm_head.weight" in tensors and "embed_out.weight" not in tensors:
        rename("lm_head.weight", "embed_out.weight")
    if family != "mixtral":
        return
    for i in range(config.n_layer):
        h = f"model.layers.{i}."
        m = h + "block_sparse_moe."
        if h + "mlp.gate.weight" in tensors:
            rename(h + "mlp.gate.weight", m + "gate.weight")
        for fused in ("gate_up_proj", "down_proj"):
            name = f"{h}mlp.experts.{fused}"
            if name not in tensors:
                continue
            t, file = tensors.pop(name), where.pop(name)
            _need(t.dim() == 3 and (fused == "down_proj" or t.shape[1] % 2 == 0), str(root / file),
                  f"tensor {name} has shape {tuple(t.shape)}; transformers' fused experts are gate_up_proj "
                  "(E, 2F, C) and down_proj (E, C, F)")
            for e in range(t.shape[0]):
                x = f"{m}experts.{e}."
                leaves = ({"w2.weight": t[e]} if fused == "down_proj"
                          else dict(zip(("w1.weight", "w3.weight"), t[e].chunk(2))))
                for leaf, w in leaves.items():
                    tensors[x + leaf], where[x + leaf] = w, file


# ---- files -----------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not found (a Hugging Face checkpoint directory holds config.json and "
                                f"{SINGLE} or {INDEX})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


class _MappedTensors(MutableMapping):
    """{name: tensor} of safetensors files opened memory-mapped (``safe_open``): a tensor is read when it is asked
    for, its shape without reading it (``shape``); tensors set in it (renamed or split ones) are held as given."""

    def __init__(self):
        self._items = {}  # name -> (safe_open handle, file path) or a tensor

    def add(self, handle, path: Path) -> None:
        for key in handle.keys():
            self._items[key] = (handle, path)

    def __getitem__(self, name):
        item = self._items[name]
        if isinstance(item, torch.Tensor):
            return item
        handle, path = item
        try:
            return handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types for a damaged file
            raise ValueError(f"{path}: tensor {name!r} is not readable (truncated or corrupt?): {exc}") from None

    def shape(self, name) -> tuple:
        item = self._items[name]
        return tuple(item.shape) if isinstance(item, torch.Tensor) else tuple(item[0].get_slice(name).get_shape())

    def rename(self, old, new) -> None:
        self._items[new] = self._items.pop(old)

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor
        return name in self._items

    def __setitem__(self, name, value):
        self._items[name] = value

    def __delitem__(self, name):
        del self._items[name]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def _shape(tensors, name) -> tuple:
    return tensors.shape(name) if isinstance(tensors, _MappedTensors) else tuple(tensors[name].shape)


def _read_tensors(root: Path, *, mapped: bool = False) -> tuple:
    """{name: tensor} of the checkpoint's safetensors files and {name: file}; errors name the file. ``mapped``: the
    files opened memory-mapped, each tensor read when asked for (``_MappedTensors``), not all read now."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    if (root / INDEX).exists():
        weight_map = _read_json(root / INDEX).get("weight_map")
        _need(isinstance(weight_map, dict) and weight_map, str(root / INDEX), "no weight_map")
        files = sorted(set(weight_map.values()))
    elif (root / SINGLE).exists():
        files = [SINGLE]
    else:
        raise FileNotFoundError(f"{root}: neither {SINGLE} nor {INDEX} (only safetensors checkpoints are read; "
                                "convert pytorch_model.bin files with transformers first)")
    tensors, where = (_MappedTensors() if mapped else {}), {}
    for name in files:
        path = root / name
        try:
            if mapped:
                handle = safe_open(str(path), framework="pt")
                tensors.add(handle, path)
                keys = list(handle.keys())
            else:
                part = load_file(str(path))
                tensors.update(part)
                keys = list(part)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: named by {INDEX} but not found") from None
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{path}: not a readable safetensors file (truncated or corrupt?): {exc}") from None
        where.update(dict.fromkeys(keys, name))
    return tensors, where


# buffers older checkpoints hold, which transformers ignores too: rotary tables, GPT-NeoX's causal mask
IGNORED = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")


def read_state(path, *, lazy: bool = False) -> tuple:
    """(megakern state dict on the CPU in the checkpoint's dtype, config) of the Hugging Face checkpoint directory
    ``path``, every tensor checked (names, shapes) and nothing built: what ``load`` and a parallel run's
    initialization (``parallelize(init_state=...)``) start from. ``lazy``: a ``LazyState`` instead of a dict, the
    files memory-mapped and each tensor made when read, one block at a time (what every rank of a run takes: its
    host memory holds a block, not the model)."""
    root = Path(path)
    _need(root.is_dir(), str(root), "not a directory")
    hf = _read_json(root / CONFIG)
    config, family = config_from_hf(hf, str(root / CONFIG))
    tensors, where = _read_tensors(root, mapped=lazy)
    _file_names(tensors, where, config, family, root)
    expected = _hf_shapes(config, family)
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{root}: the {family} checkpoint lacks tensor {missing[0]!r}{more} (files "
                         f"{sorted(set(where.values()))})")
    extra = sorted(n for n in tensors if n not in expected and not n.endswith(IGNORED)
                   and not (config.tie_embeddings and n == output_name(family)))
    if extra:
        raise ValueError(f"{root}: tensors megakern does not use: {extra[:8]}{' ...' if len(extra) > 8 else ''} "
                         f"(in {sorted({where[n] for n in extra})})")
    for name, shape in expected.items():
        got = _shape(tensors, name)
        _need(got == shape, str(root / where[name]), f"tensor {name} has shape {got}; {CONFIG} asks for {shape}")
    if lazy:
        return LazyState(tensors, expected, config, family), config
    return state_from_hf(tensors, config, family), config


def read_config(path) -> GPTConfig:
    """The megakern GPTConfig of the Hugging Face checkpoint directory ``path`` (its config.json alone)."""
    root = Path(path)
    return config_from_hf(_read_json(root / CONFIG), str(root / CONFIG))[0]


def load(path, *, dtype: torch.dtype | None = None, device="cpu") -> tuple[GPT, GPTConfig]:
    """(model, config) of the Hugging Face checkpoint directory ``path``; weights in ``dtype`` (default: as stored)
    on ``device``. Unused tensors other than the buffers transformers ignores (``IGNORED``) are an error, as are
    missing ones."""
    state, config = read_state(path)
    return GPT.from_state(config, state, dtype=dtype, device=device), config


def _hf_shapes(config: GPTConfig, family: str) -> dict:
    """{tensor name: shape} of a ``family`` checkpoint of ``config``."""
    with torch.device("meta"):
        state = GPT(config).state_dict()
    return {name: tuple(t.shape) for name, t in state_to_hf(state, config, family).items()}


def save(model: GPT, path, *, family: str | None = None, dtype: torch.dtype | None = None,
         max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Writes ``model`` (a megakern GPT, or its state dict with ``model.config``) as a Hugging Face checkpoint
    directory ``path`` (config.json, model.safetensors or shards with their index) in ``dtype`` (default: the
    model's). ``family``: "gpt2" | "llama" | "mistral" | "qwen2" | "gpt_neox" | "mixtral" (default: the one its
    config matches; a llama may be written as a mistral and back). ``path`` must not exist or be an empty
    directory; on any error nothing is left there."""
    from safetensors.torch import save_file

    config = model.config
    family = family or family_of(config)
    _need(family in FAMILIES.values(), "save", f"family {family!r} (known: {sorted(FAMILIES.values())})")
    natural = family_of(config)
    if family != natural and {family, natural} != {"llama", "mistral"}:
        raise ValueError(f"save: a {natural} model cannot be written as {family}")
    state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    dtype = dtype or next(iter(state.values())).dtype
    tensors = {k: v.to(dtype) for k, v in state_to_hf(state, config, family).items()}
    target = Path(path)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target}: exists and is not an empty directory; nothing written")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        (tmp / CONFIG).write_text(json.dumps(config_to_hf(config, family, dtype), indent=2) + "\n")
        shards, size = [{}], 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        metadata = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SINGLE), metadata=metadata)
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata=metadata)
                weight_map.update({k: name for k in shard})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2) + "\n")
        if target.exists():
            target.rmdir()
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
