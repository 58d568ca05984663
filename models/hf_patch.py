"""megakern's kernels inside Hugging Face models: ``patch(model)`` swaps a transformers Llama, Mistral or Qwen2
model's RMSNorm, rotary + attention, SwiGLU and loss for megakern's, in place, for training.

    from transformers import AutoModelForCausalLM
    from megakern.models.hf_patch import patch

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).cuda()
    patch(model)                      # or patch(model, rms_norm=False, backend="triton"), ...
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss

What each switch replaces (each on by default; the parameters, their names and the state dict stay HF's, so
``save_pretrained``, optimizers, FSDP wrapping and checkpoints see the same model):

- ``rms_norm``: every ``*RMSNorm`` module's forward becomes ``megakern.rms_norm`` (one pass, fp32 math; the
  output in the input's dtype, where HF multiplies an fp32 weight by the bf16 activations in fp32).
- ``attention``: each attention module's forward computes q, k, v with its own projections, rotates q and k in one
  launch of ``megakern.apply_rotary`` (the cos / sin the model computed for this batch, so every RoPE variant and
  any ``position_ids`` are HF's), runs ``megakern.attention`` (causal, grouped-query without repeating k / v,
  Mistral's and Qwen2's sliding window) and its o_proj. Where that would not be HF's attention the call takes the
  module's own forward, unchanged, and the model logs why once: an attention mask (padding, or a sliding window
  shorter than the sequence, for which transformers builds a mask), a KV cache (generation), attention weights
  asked for, dropout in training. Packed sequences (batch 1 with ``cu_seq_lens_q`` / ``cu_seq_lens_k`` and
  ``max_length_q`` in the call's keyword arguments, as transformers' flattening collator gives flash attention)
  attend within each document.
- ``swiglu``: the MLP computes gate and up as one GEMM over their interleaved rows (a bf16 copy of the two weights
  per forward, as autocast's own cast) and ``megakern.swiglu``: one pass each way instead of silu, multiply and
  their backwards.
- ``loss``: with ``labels``, the causal LM's forward runs the decoder, then ``megakern.linear_cross_entropy`` over
  the shifted labels (``shift_labels`` and ``num_items_in_batch`` honoured as transformers does): the (tokens,
  vocabulary) logits are never made, and the output's ``logits`` is None. Without labels the model's own forward
  runs. The decoder runs without a KV cache unless the call asks for one.

``backend``: megakern's backend for every op ('torch' | 'triton' | 'cuda', or a {op: backend} table); None picks
the fastest on the tensors' device. On a CPU the ops take their torch references (the patched model's arithmetic,
tested against the unpatched one); on a GPU, the kernels.

What is checked (ValueError / TypeError naming the problem, nothing changed): the model is a transformers
``*ForCausalLM`` of a supported model_type; biases in the MLP, a hidden_act other than silu, a head dim megakern's
attention lacks, or an attention dropout in the config are refused for the switch they concern; a model patched twice
is refused (``unpatch`` restores the original forwards).
"""
from __future__ import annotations

import functools
import logging
import types

import torch
import torch.nn.functional as F

import megakern
from megakern.attention import HEAD_DIMS

SUPPORTED = ("llama", "mistral", "qwen2")
SWITCHES = ("rms_norm", "attention", "swiglu", "loss")
_MARK = "_megakern_patch"  # on the top model: {module: original forward} of every patched module

log = logging.getLogger("megakern.hf_patch")


def _modules(model, suffix: str) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith(suffix)]


def _check(model) -> str:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind is None or not isinstance(model, torch.nn.Module):
        raise TypeError(f"patch: expected a transformers *ForCausalLM model (a module with a .config), got "
                        f"{type(model).__name__}")
    if kind not in SUPPORTED:
        raise ValueError(f"patch: model_type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
    if not hasattr(model, "lm_head") or not hasattr(model, "model"):
        raise TypeError(f"patch: expected a {kind} *ForCausalLM (with .model and .lm_head), got {type(model).__name__}")
    if hasattr(model, _MARK):
        raise ValueError("patch: this model is patched already (megakern.models.hf_patch.unpatch(model) first)")
    return kind


def patch(model, *, rms_norm: bool = True, attention: bool = True, swiglu: bool = True, loss: bool = True,
          backend=None):
    """Swaps the chosen parts of ``model`` (a transformers Llama / Mistral / Qwen2 causal LM) for megakern's kernels
    in place (see the module doc); returns the model."""
    _check(model)
    config = model.config
    plan = []  # (module, new forward)
    if rms_norm:
        norms = _modules(model, "RMSNorm")
        if not norms:
            raise ValueError(f"patch: no RMSNorm module found in {type(model).__name__}")
        plan += [(m, _rms_norm_forward) for m in norms]
    if attention:
        hs = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if hs not in HEAD_DIMS:
            raise ValueError(f"patch: head dim {hs} is not one megakern's attention runs (multiples of 16 up to 256); "
                             "pass attention=False")
        if getattr(config, "attention_dropout", 0.0):
            raise ValueError(f"patch: attention_dropout {config.attention_dropout} in the config: megakern's attention "
                             "has no dropout; pass attention=False")
        layers = _modules(model, "Attention")
        if not layers:
            raise ValueError(f"patch: no attention module found in {type(model).__name__}")
        plan += [(m, _attention_forward) for m in layers]
        eager = getattr(config, "_attn_implementation", None) == "eager"
        if eager and not hasattr(model, "set_attn_implementation"):
            raise ValueError("patch: the model uses transformers' eager attention, whose causal mask the patched "
                             "attention cannot skip; load it with attn_implementation='sdpa'")
    if swiglu:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"patch: hidden_act {config.hidden_act!r}: megakern's SwiGLU gates with silu; pass "
                             "swiglu=False")
        if getattr(config, "mlp_bias", False):
            raise ValueError("patch: mlp_bias true: megakern's SwiGLU path has no biases; pass swiglu=False")
        mlps = [m for m in _modules(model, "MLP") if all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj"))]
        if not mlps:
            raise ValueError(f"patch: no gated MLP (gate_proj, up_proj, down_proj) found in {type(model).__name__}")
        plan += [(m, _mlp_forward) for m in mlps]
    if loss:
        if getattr(model.lm_head, "bias", None) is not None:
            raise ValueError("patch: the lm_head has a bias; megakern's fused loss path takes none: pass loss=False")
        plan.append((model, _causal_lm_forward))
    if attention and eager:
        # transformers builds a causal mask for every call of its eager attention, so the patched forward could only
        # fall back; its SDPA implementation leaves the mask out where the causal flag says it all
        model.set_attn_implementation("sdpa")
        log.info("megakern.hf_patch: attention implementation eager -> sdpa (its mask-free calls are patched)")
    originals = {}
    for module, forward in plan:
        originals[module] = module.forward
        module.forward = types.MethodType(functools.partial(forward, backend=backend, original=module.forward),
                                          module)
    setattr(model, _MARK, originals)
    return model


def unpatch(model):
    """Restores the forwards ``patch`` replaced; returns the model."""
    originals = getattr(model, _MARK, None)
    if originals is None:
        raise ValueError("unpatch: the model is not patched")
    for module in originals:
        if "forward" in vars(module):
            del module.forward  # the instance attribute: the class's forward again
    delattr(model, _MARK)
    return model


def is_patched(model) -> bool:
    return hasattr(model, _MARK)


# ---- the replacement forwards (bound to their module; ``original`` is its own forward) ----------------------------
def _rms_norm_forward(self, hidden_states, *, backend, original):
    weight = self.weight
    if weight.dtype != hidden_states.dtype and weight.dtype != torch.float32:
        weight = weight.float()  # another low precision than x: read in fp32 (megakern.rms_norm takes x's or fp32)
    return megakern.rms_norm(hidden_states, weight, self.variance_epsilon, backend=backend)


def _fallback(self, why: str, original, args, kwargs):
    if not getattr(self, "_megakern_fallback_logged", False):
        log.warning("megakern.hf_patch: %s layer %s takes transformers' attention: %s", type(self).__name__,
                    getattr(self, "layer_idx", "?"), why)
        self._megakern_fallback_logged = True
    return original(*args, **kwargs)


def _why_not(self, attention_mask, kwargs) -> str:
    cache = next((kwargs[k] for k in ("cache", "past_key_values", "past_key_value") if kwargs.get(k) is not None),
                 None)
    if attention_mask is not None:
        return "an attention mask (padding, or a sliding window shorter than the sequence)"
    if cache is not None:
        return "a KV cache (generation)"
    if kwargs.get("output_attentions"):
        return "attention weights asked for"
    if self.training and getattr(self, "attention_dropout", 0.0):
        return "attention dropout in training"
    return ""


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, backend, original,
                       **kwargs):
    why = "" if position_embeddings is not None and not args else "no position embeddings given"
    why = why or _why_not(self, attention_mask, kwargs)
    if why:
        return _fallback(self, why, original, (hidden_states, position_embeddings, attention_mask, *args), kwargs)
    B, T = hidden_states.shape[:2]
    hs = self.head_dim
    q = self.q_proj(hidden_states).view(B * T, -1, hs)  # (B T, nh, hs): one row of cos / sin per token
    k = self.k_proj(hidden_states).view(B * T, -1, hs)
    v = self.v_proj(hidden_states).view(B, T, -1, hs)
    cos, sin = position_embeddings  # (B or 1, T, hs): [angles, angles] (rotate-half), scaled as the model's RoPE
    half = cos.shape[-1] // 2
    cos, sin = (t[..., :half].expand(B, T, half).reshape(B * T, half) for t in (cos, sin))
    if cos.dtype not in (torch.float32, q.dtype):
        cos, sin = cos.float(), sin.float()
    # positions 0 .. B T - 1 of the (B T)-row table: each token its own angles, whatever the position ids were
    q, k = megakern.apply_rotary(q.unsqueeze(0), k.unsqueeze(0), cos, sin, backend=backend)
    window = getattr(self, "sliding_window", None)
    if window is None and getattr(self.config, "model_type", "") == "mistral":
        window = getattr(self.config, "sliding_window", None)
    left = (window - 1, 0) if window is not None and window < T else None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None:
        if B != 1 or cu_k is None or not torch.equal(cu_q, cu_k):
            raise ValueError(f"{type(self).__name__}: packed sequences take batch 1 and equal cu_seq_lens_q / "
                             f"cu_seq_lens_k (got batch {B})")
        out = megakern.attention(q[0], k[0], v[0], causal=True, softmax_scale=self.scaling,
                                 cu_seqlens=cu_q.to(torch.int32), max_seqlen=kwargs.get("max_length_q"),
                                 window=left, backend=backend)
    else:
        out = megakern.attention(q.view(B, T, -1, hs), k.view(B, T, -1, hs), v, causal=True,
                                 softmax_scale=self.scaling, window=left, backend=backend)
    return self.o_proj(out.reshape(B, T, -1)), None


def _mlp_forward(self, x, *, backend, original):
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    gate, up = self.gate_proj.weight, self.up_proj.weight
    # rows 2i / 2i + 1: unit i's gate / up projection, megakern.swiglu's layout
    w = torch.stack((gate.to(dtype), up.to(dtype)), dim=1).flatten(0, 1)
    with torch.autocast(kind, enabled=False):
        h = F.linear(x.to(dtype), w)
    return self.down_proj(megakern.swiglu(h, backend=backend))


_LOSS_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, *args, labels=None, backend,
                       original, **kwargs):
    if labels is None or args:  # logits (generation, evaluation), or arguments passed by position: HF's forward
        if labels is not None:
            kwargs["labels"] = labels
        return original(input_ids, attention_mask, position_ids, *args, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    extra = {k: kwargs.pop(k) for k in _LOSS_KWARGS if k in kwargs}
    kwargs.pop("logits_to_keep", None)
    kwargs.pop("return_dict", None)
    kwargs.setdefault("use_cache", False)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    ignore = extra.get("ignore_index", -100)
    shift = extra.get("shift_labels")
    if shift is None:
        if labels.shape != hidden.shape[:-1]:
            raise ValueError(f"{type(self).__name__}: labels of shape {tuple(labels.shape)} do not match the tokens "
                             f"{tuple(hidden.shape[:-1])}")
        shift = F.pad(labels, (0, 1), value=ignore)[..., 1:]  # token t predicts label t + 1
    elif shift.shape != hidden.shape[:-1]:
        raise ValueError(f"{type(self).__name__}: shift_labels of shape {tuple(shift.shape)} do not match the tokens "
                         f"{tuple(hidden.shape[:-1])}")
    shift = shift.to(hidden.device)
    items = extra.get("num_items_in_batch")
    loss = megakern.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                                         shift.reshape(-1), ignore_index=ignore,
                                         reduction="mean" if items is None else "sum", backend=backend)
    if items is not None:
        loss = loss / (items.to(loss.device) if torch.is_tensor(items) else items)
    fields = {"loss": loss, "logits": None, "hidden_states": getattr(outputs, "hidden_states", None),
              "attentions": getattr(outputs, "attentions", None)}
    for name in ("cache", "past_key_values"):  # the cache's field name differs across transformers versions
        if name in CausalLMOutputWithPast.__dataclass_fields__:
            fields[name] = getattr(outputs, name, None)
    return CausalLMOutputWithPast(**fields)
