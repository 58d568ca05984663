"""Text generation from a GPT with a preallocated key/value cache.

    tokens = generate(model, idx, max_new_tokens, temperature=0.8, top_k=50, generator=g, eos_id=tokenizer.eod_id)

The prompt idx (B, T) goes through the model once (prefill), filling every layer's cache with its keys and values;
each new token then costs one step over one position, attending to the cache (``megakern.attention`` aligns the
causal mask bottom-right, so the single query sees every cached key). Positions continue from the prompt's length
(rotary by ``offset``, learned rows of wpe).

Before anything is allocated, the length is validated (T + max_new_tokens <= max_seqlen) and the cache's size,
n_layer * 2 * B * (T + max_new_tokens) * nkv * hs elements in the model's dtype, is checked against the device's
free memory; a cache that does not fit raises MemoryError saying how much it needs. The model runs in eval mode
under no_grad, and its previous mode is restored afterwards, also on errors.

Sampling: logits of the real vocabulary only (the padded rows never come out), divided by ``temperature`` (0:
greedy argmax), cut to the ``top_k`` largest, then to the nucleus of ``top_p`` (the most likely tokens whose
probabilities sum to top_p), then drawn with ``generator``. ``eos_id`` (an id or a list of ids,
checked against the vocabulary): a sequence that emits one is padded with the first stop id from then on, and
generation stops early once every sequence has stopped.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from megakern.models.gpt import GPT, _split_qkv

MEMORY_MARGIN = 0.9  # the cache may take this fraction of the free memory


def available_bytes(device: torch.device) -> int:
    """Free memory on ``device``: the CUDA driver's free bytes, or the host's available physical memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        return 1 << 62


def _stop_ids(eos_id, vocab_size: int) -> list[int]:
    ids = [] if eos_id is None else [eos_id] if isinstance(eos_id, int) and not isinstance(eos_id, bool) else eos_id
    if not isinstance(ids, Sequence) or isinstance(ids, str):
        raise TypeError(f"generate: eos_id must be None, an int or a list of ints, got {eos_id!r}")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise ValueError(f"generate: stop id {i!r} is not a token of the vocabulary [0, {vocab_size})")
    return list(ids)


def _check(model: GPT, idx, max_new_tokens, temperature, top_k, top_p=None) -> None:
    config = model.config
    if not isinstance(model, GPT):
        raise TypeError(f"generate: model must be a megakern GPT, got {type(model).__name__}")
    if model.wte is None or model.norm_f is None or len(model.blocks) != config.n_layer:
        raise ValueError("generate: the model is a pipeline stage (embedding, final norm or blocks removed); "
                         "generation needs the whole model")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"generate: idx must be a (B, T) int64 tensor of token ids, got "
                         f"{tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__}")
    if idx.shape[1] == 0:
        raise ValueError("generate: the prompt is empty (T = 0); give at least one token")
    if idx.device != model.wte.weight.device:
        raise ValueError(f"generate: idx is on {idx.device} but the model is on {model.wte.weight.device}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    total = idx.shape[1] + max_new_tokens
    if total > config.max_seqlen:
        raise ValueError(f"generate: prompt ({idx.shape[1]}) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
                         f"the model's max_seqlen ({config.max_seqlen})")
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature)
            or temperature < 0):
        raise ValueError(f"generate: temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or not 1 <= top_k <= config.vocab_size):
        raise ValueError(f"generate: top_k must be None or an int in 1..{config.vocab_size}, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"generate: top_p must be None or a number in (0, 1], got {top_p!r}")
    if idx.numel():
        lo, hi = (int(v) for v in torch.aminmax(idx))
        if lo < 0 or hi >= config.vocab_size:
            raise ValueError(f"generate: prompt ids span {lo}..{hi}, outside the vocabulary [0, {config.vocab_size})")


def _allocate_cache(model: GPT, batch: int, length: int):
    """Per layer (k, v), each (B, length, nkv, hs) in the dtype of the keys the model makes (the model's, or
    autocast's under torch.autocast), after checking that they fit."""
    config, weight = model.config, model.wte.weight
    kind = weight.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else weight.dtype
    shape = (config.n_layer, 2, batch, length, config.n_kv_head, config.head_dim)
    need = math.prod(shape) * dtype.itemsize
    free = available_bytes(weight.device)
    if need > MEMORY_MARGIN * free:
        raise MemoryError(f"generate: the KV cache needs {need / 2**30:.2f} GiB ({config.n_layer} layers x 2 x batch "
                          f"{batch} x {length} positions x {config.n_kv_head} heads x {config.head_dim}), but "
                          f"{weight.device} has {free / 2**30:.2f} GiB free; use a shorter length or a smaller batch")
    cache = torch.empty(shape, dtype=dtype, device=weight.device)
    return [(cache[i, 0], cache[i, 1]) for i in range(config.n_layer)]


def _attention_step(attn, y, k_cache, v_cache, start: int, rope):
    """One block's attention over positions start .. start + T - 1, appending their keys and values to the cache."""
    B, T, _ = y.shape
    nkv, hs = attn.n_kv_head, attn.head_dim
    q, k, v = _split_qkv(attn.qkv(y).view(B, T, nkv, attn.n_head // nkv + 2, hs), nkv, hs)
    if rope is not None:
        q, k = rope(q, k, offset=start)
    k_cache[:, start:start + T] = k
    v_cache[:, start:start + T] = v
    out = attn.core(q, k_cache[:, :start + T], v_cache[:, :start + T], cu_seqlens=None, max_seqlen=None)
    return attn.proj(out.reshape(B, T, attn.n_head * hs))


def _forward_step(model: GPT, idx, cache, start: int) -> torch.Tensor:
    """Logits (B, vocab_size) of the next token after idx (B, T) at positions start .. start + T - 1."""
    T = idx.shape[1]
    x = model.wte(idx)
    if model.wpe is not None:
        x = x + model.wpe(torch.arange(start, start + T, device=idx.device))
    residual = None
    for block, (k_cache, v_cache) in zip(model.blocks.values(), cache):
        # the block's own norms and MLP (sequential or parallel residual); its attention over the cache
        x, residual = block(x, residual, None,
                            attend=lambda y: _attention_step(block.attn, y, k_cache, v_cache, start, model.rope))
    y = model.norm_f(x[:, -1:], residual[:, -1:])[0]
    return F.linear(y[:, 0], model.output_weight()[:model.config.vocab_size]).float()


def _sample(logits, temperature: float, top_k, generator, top_p=None):
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        # nucleus: the most likely tokens whose probabilities sum to top_p (the first one always kept)
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # the mass of the tokens ranked above each
        sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)[:, 0]


def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None, eos_id: int | Sequence[int] | None = None,
             top_p: float | None = None) -> torch.Tensor:
    """idx (B, T) prompt ids -> (B, T + n) ids, n <= max_new_tokens (fewer when every sequence stopped at eos_id).

    ``temperature`` 0 is greedy; ``top_k`` keeps the k most likely tokens, ``top_p`` the most likely ones whose
    probabilities sum to top_p (after top_k); ``generator`` seeds the draws.
    """
    _check(model, idx, max_new_tokens, temperature, top_k, top_p)
    stops = _stop_ids(eos_id, model.config.vocab_size)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            B, T = idx.shape
            idx = idx.long()
            if max_new_tokens == 0:
                return idx.clone()
            cache = _allocate_cache(model, B, T + max_new_tokens)
            out = torch.empty(B, T + max_new_tokens, dtype=torch.long, device=idx.device)
            out[:, :T] = idx
            stop = torch.tensor(stops, dtype=torch.long, device=idx.device)
            done = torch.zeros(B, dtype=torch.bool, device=idx.device)
            logits = _forward_step(model, idx, cache, 0)  # prefill
            for i in range(max_new_tokens):
                token = _sample(logits, temperature, top_k, generator, top_p)
                if stops:
                    token = torch.where(done, stop[0], token)  # a finished sequence repeats its stop id
                    done |= torch.isin(token, stop)
                out[:, T + i] = token
                if stops and bool(done.all()):
                    return out[:, :T + i + 1]
                if i + 1 < max_new_tokens:
                    logits = _forward_step(model, token[:, None], cache, T + i)
            return out
    finally:
        model.train(was_training)
