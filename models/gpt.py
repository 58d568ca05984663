"""GPT: a decoder-only transformer built from megakern's kernels, in one file.

    idx (B, T) -> wte (+ wpe) -> dropout -> n_layer x Block -> norm_f -> lm_head -> logits (B, T, V)
    Block:  y, h = attn_norm(x, residual=h)      h: the residual stream, the add fused into the norm
            x    = dropout(attn(y))
            y, h = mlp_norm(x, residual=h)
            x    = dropout(mlp(y))
    attn:   qkv = qkv(y) (B, T, nkv, g + 2, hs), g = nh / nkv query heads per kv head
            q, k, v = views of qkv; q, k rotated (RoPE) in place
            out = core(q, k, v) = megakern.attention(causal), (B, T, nh, hs) -> proj
    mlp:    proj(gelu(fc(y)))  or  proj(silu(gate) * up) with (gate, up) interleaved rows of fc (SwiGLU); with a
            bias, gelu(y W^T + b) is megakern.bias_gelu (its backward also makes the bias gradient), without one
            megakern.bias_gelu(y W^T, None); "gelu_exact" the erf GELU (GPT-NeoX's, torch's F.gelu)
    parallel_residual (GPT-NeoX): both branches read the same stream, h + attn(attn_norm(h)) + mlp(mlp_norm(h)):
            y, h = attn_norm(x, residual=h); x = attn(y) + mlp(mlp_norm(h))

Letters: B batch, T sequence, C = n_embd, nh / nkv query / key-value heads, hs head dim, V the padded vocabulary.

Kernels: every op takes its backend from ``config.kernels`` (``{op: backend}``, passed as ``backend=`` to the
megakern ops: "rms_norm" | "layer_norm" | "rotary" | "attention" | "cross_entropy" | "bias_gelu" | "swiglu" |
"linear" | "moe" | "grouped_mm" | "qkv_order" | "embedding", ``KERNEL_OPS``); an op not named takes the fastest
backend available for the tensors' device (the torch references on CPU).

Loss: ``forward(idx, targets)`` returns the cross-entropy of the next tokens through
``megakern.linear_cross_entropy``, which never holds fp32 logits for the whole vocabulary (chunked over tokens).

Packed documents: ``cu_seqlens`` (ndocs + 1,) int32 offsets into the B * T flattened tokens; attention stays inside
each document and positions (rotary or learned) restart at 0 in each.

Construction: modules are built on the meta device, then materialized on the default device and initialized
(``init_weights``) unless the caller is itself under ``torch.device("meta")``, so a model is never allocated and
initialized twice:

    with torch.device("meta"):
        model = GPT(GPTConfig.preset("gpt-350m"))
    model.to_empty(device="cuda"); model.init_weights()

Mixture of Experts (``config.n_experts`` > 0): the blocks moe_first_dense, moe_first_dense + moe_every, ... take
models/moe.py's MoEMLP instead of the dense MLP (routed experts, optional shared ones, the router's aux and z losses
attached to its output); ``num_params(active=True)`` and ``flops_per_token`` count the k routed experts a token
uses, not all E.

Activation recomputation (``config.recompute``): "none"; "selective" recomputes the attention core in the backward
(keeps q, k, v; drops the output and the log-sum-exp); "full" recomputes each block from its inputs.
"""
from __future__ import annotations

import copy

import dataclasses
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import megakern
from megakern import rotary
from megakern._checks import document_lengths
from megakern.activation import bias_gelu_backend
from megakern.attention import packed_qkv
from megakern.cross_entropy import linear_cross_entropy
from megakern.linear import linear_backend
from megakern.qkv_order import qkv_rows
from megakern.models.moe import MoEMLP, stat_width

NORMS = ("layernorm", "rmsnorm")
POSITIONS = ("rotary", "learned")
ACTIVATIONS = ("gelu", "gelu_exact", "swiglu")
RECOMPUTE = ("none", "selective", "full")
# weights initialized with std init_std / sqrt(2 n_layer) under scaled_init (names end so)
OUTPUT_PROJECTIONS = ("attn.proj.weight", "mlp.proj.weight", "mlp.shared.proj.weight", "mlp.w_out")
VOCAB_MULTIPLE = 128
KERNEL_OPS = ("rms_norm", "layer_norm", "rotary", "attention", "cross_entropy", "bias_gelu", "swiglu", "linear",
              "moe", "grouped_mm", "qkv_order", "embedding")
IGNORE_INDEX = -100


# ---- config ------------------------------------------------------------------------------------------------------
@dataclass
class GPTConfig:
    """The architecture of a GPT. ``None`` for n_kv_head / ffn_hidden is resolved at construction (n_head; 4 * n_embd
    for gelu, 8/3 * n_embd rounded up to a multiple of 64 for swiglu)."""

    n_layer: int = 12
    """Transformer blocks."""
    n_embd: int = 768
    """Hidden size C (the residual stream's width)."""
    n_head: int = 12
    """Query heads nh; the head dim is n_embd // n_head."""
    n_kv_head: Optional[int] = None
    """Key/value heads nkv (grouped-query attention: nkv divides nh; nkv == nh is multi-head attention)."""
    ffn_hidden: Optional[int] = None
    """MLP hidden size F (for swiglu the size of each of gate and up)."""
    vocab_size: int = 50257
    """Tokens the tokenizer makes (ids 0 .. vocab_size - 1); the embedding holds ``padded_vocab`` rows."""
    max_seqlen: int = 1024
    """Longest sequence (or packed document): the learned position table's length, the rotary table's length."""
    norm: str = "layernorm"
    """"layernorm" | "rmsnorm"."""
    norm_eps: float = 1e-5
    """The norms' epsilon."""
    position: str = "learned"
    """"learned" (an absolute position table wpe) | "rotary" (RoPE on q and k)."""
    rotary_pct: float = 1.0
    """Fraction of the head dim that is rotated (GPT-NeoX's rotary_pct); rotary_dim = hs * rotary_pct rounded down to
    even."""
    rotary_base: float = 10000.0
    """RoPE base (rope_theta)."""
    rope_scaling: Optional[dict] = None
    """A Llama-family rope_scaling dict ({"rope_type": "llama3", "factor": 8.0, ...}), or None."""
    activation: str = "gelu"
    """"gelu" (tanh approximation, as GPT-2) | "gelu_exact" (the erf GELU, as GPT-NeoX; no fused bias + GELU kernel)
    | "swiglu" (silu(gate) * up)."""
    tie_embeddings: bool = True
    """The output projection reuses wte's weight (no lm_head parameters)."""
    dropout: float = 0.0
    """Dropout probability on the embeddings and on each block's attention and MLP outputs."""
    bias: bool = True
    """Biases in the linear layers and LayerNorms."""
    qkv_bias: Optional[bool] = None
    """Biases in the attention's qkv projection alone (Qwen2: true with bias false); None: as ``bias``."""
    parallel_residual: bool = False
    """Each block adds its attention and its MLP to the same residual stream, x + attn(attn_norm(x)) +
    mlp(mlp_norm(x)) (GPT-NeoX's use_parallel_residual); false: sequential, the MLP reads the stream after the
    attention's add."""
    mask_padded_vocab: bool = False
    """The loss's softmax leaves out the padded vocabulary's columns (ids vocab_size .. padded_vocab - 1): set for
    models imported from Hugging Face (megakern.models.hf), whose padding rows start at zero and whose loss is then
    transformers'; false counts them, as Megatron-LM and nanoGPT do, their rows trained down like any other."""
    init_std: float = 0.02
    """Standard deviation of the normal initialization of embeddings and linear weights."""
    scaled_init: bool = True
    """Output projections (attn.proj, mlp.proj) start with std init_std / sqrt(2 * n_layer) (GPT-2)."""
    init_from: Optional[str] = None
    """Weights to start from instead of the random initialization: 'hf:DIR', a Hugging Face checkpoint directory
    (megakern.models.hf), whose config.json also gives the architecture (model keys beside it override its fields:
    dropout, kernels, recompute, ...; a preset with it is an error)."""
    recompute: str = "none"
    """Activation recomputation: "none" | "selective" (the attention core) | "full" (each block)."""
    deterministic_attention: bool = True
    """The attention backward without atomics, bitwise reproducible (two passes, megakern.attention's default); False:
    the single-pass backward where it is the faster one (dq added into fp32 by TMA reduces: head dims 64, 96 and 128
    on Hopper, docs/tuning.md), run-to-run differences in the last bits allowed."""
    kernels: dict = field(default_factory=dict)
    """Backend per op, {op: "torch" | "triton" | "cuda"}, ops: rms_norm, layer_norm, rotary, attention,
    cross_entropy, bias_gelu (the MLP's tanh GELU, with fc's bias if any), linear (the other biased projections'
    bias gradient), moe (the experts' permute / unpermute), grouped_mm (the experts' GEMMs), qkv_order (the fused
    qkv weight's rows in the heads-major order, grouped queries), embedding (wte's lookup; its gradient in one
    pass); ops not named take the fastest available backend."""
    ce_chunk: Optional[int] = None
    """Tokens per chunk of the fused linear cross-entropy (None: chosen from the vocabulary size)."""
    n_experts: int = 0
    """Routed experts E of the MoE blocks (0: every block dense)."""
    moe_top_k: int = 2
    """Experts each token is routed to (k <= n_experts)."""
    moe_ffn_hidden: Optional[int] = None
    """Hidden size of each expert (and of each shared expert); None: ffn_hidden."""
    moe_every: int = 1
    """Every moe_every-th block from moe_first_dense on is an MoE block."""
    moe_first_dense: int = 0
    """Leading blocks that stay dense (DeepSeek's first_k_dense)."""
    moe_shared_experts: int = 0
    """Shared experts every token goes through (one dense MLP of moe_shared_experts * moe_ffn_hidden units)."""
    moe_router: str = "softmax"
    """"softmax" (Mixtral: top-k of the softmax) | "sigmoid" (DeepSeek-V3: sigmoid scores, experts chosen with a
    per-expert balancing bias updated from the load, auxiliary-loss-free)."""
    moe_renormalize: bool = False
    """Renormalize the k routing weights of a token to sum 1."""
    moe_capacity_factor: Optional[float] = None
    """None: dropless; else each expert keeps at most ceil(factor * tokens * k / E) assignments, those of the
    highest router scores (models/moe.py)."""
    moe_force_balance: bool = False
    """For throughput benchmarks only: each token's k experts are drawn at random (an even load in expectation, as a
    trained router's) instead of the router's top-k; the weights are still the router's scores of those experts, so
    it gets gradients. A model trained so learns no routing."""
    moe_aux_loss_coef: float = 0.01
    """Coefficient of the Switch/Mixtral load-balancing loss (0 disables it; it is still logged)."""
    moe_z_loss_coef: float = 0.0
    """Coefficient of the router z-loss (0 disables it; it is still logged)."""
    moe_bias_update_rate: float = 1e-3
    """The sigmoid router's bias update per optimizer step: bias_e += rate * sign(mean load - load_e) (0: fixed
    bias; the softmax router has no bias)."""
    moe_n_groups: int = 1
    """Expert groups for group-limited routing (1: none); divides n_experts."""
    moe_topk_groups: int = 1
    """Groups a token may route to (with moe_n_groups > 1)."""

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.ffn_hidden is None and isinstance(self.n_embd, int):
            self.ffn_hidden = 4 * self.n_embd if self.activation != "swiglu" else _round_up(8 * self.n_embd // 3, 64)
        self.kernels = dict(self.kernels) if self.kernels is not None else {}
        if self.moe_ffn_hidden is None and isinstance(self.n_experts, int) and self.n_experts > 0:
            self.moe_ffn_hidden = self.ffn_hidden

    def is_moe_block(self, i: int) -> bool:
        """Whether block ``i`` holds an MoE MLP."""
        return (self.n_experts > 0 and i >= self.moe_first_dense
                and (i - self.moe_first_dense) % self.moe_every == 0)

    @property
    def moe_blocks(self) -> list[int]:
        """The MoE blocks' indices (their order is the rows of the MoE statistics)."""
        return [i for i in range(self.n_layer) if self.is_moe_block(i)]

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab(self) -> int:
        """vocab_size rounded up to a multiple of 128 (tensor-core friendly GEMMs, TP shards)."""
        return _round_up(self.vocab_size, VOCAB_MULTIPLE)

    @property
    def rotary_dim(self) -> int:
        """Features of each head that RoPE rotates (0 with learned positions)."""
        if self.position != "rotary":
            return 0
        return int(self.head_dim * self.rotary_pct) // 2 * 2

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """The named preset (see ``PRESETS``) with fields replaced by ``overrides``; validated."""
        if name not in PRESETS:
            raise ValueError(f"GPTConfig: unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(overrides) - fields):
            raise ValueError(f"GPTConfig: unknown fields {unknown}; fields: {', '.join(sorted(fields))}")
        config = cls(**{**copy.deepcopy(PRESETS[name]), **overrides})  # no config shares the table's dicts
        config.validate()
        return config

    def validate(self) -> "GPTConfig":
        """Raise ValueError naming every bad field and its value; returns self."""
        errors = []

        def need(ok: bool, message: str):
            if not ok:
                errors.append(message)

        for name in ("n_layer", "n_embd", "n_head", "n_kv_head", "ffn_hidden", "vocab_size", "max_seqlen"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                 f"{name} must be an int >= 1, got {value!r}")
        if errors:
            raise ValueError("GPTConfig: " + "; ".join(errors))
        need(self.n_embd % self.n_head == 0, f"n_head ({self.n_head}) must divide n_embd ({self.n_embd})")
        need(self.n_head % self.n_kv_head == 0,
             f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head}) (grouped-query attention)")
        need(self.init_from is None or (isinstance(self.init_from, str) and self.init_from.startswith("hf:")
                                        and len(self.init_from) > 3),
             f"init_from must be 'hf:DIR' (a Hugging Face checkpoint directory) or null, got {self.init_from!r}")
        need(self.qkv_bias is None or isinstance(self.qkv_bias, bool),
             f"qkv_bias must be true, false or null (as bias), got {self.qkv_bias!r}")
        need(self.norm in NORMS, f"norm must be one of {NORMS}, got {self.norm!r}")
        need(self.position in POSITIONS, f"position must be one of {POSITIONS}, got {self.position!r}")
        need(self.activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        need(self.recompute in RECOMPUTE, f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        for name in ("norm_eps", "init_std", "rotary_base", "rotary_pct", "dropout"):
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                 f"{name} must be a finite number, got {value!r}")
        if not errors:
            need(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
            need(self.init_std > 0, f"init_std must be > 0, got {self.init_std}")
            need(0 <= self.dropout < 1, f"dropout must be in [0, 1), got {self.dropout}")
            if self.position == "rotary":
                need(0 < self.rotary_pct <= 1, f"rotary_pct must be in (0, 1], got {self.rotary_pct}")
                need(self.rotary_base > 1, f"rotary_base must be > 1, got {self.rotary_base}")
                if self.n_embd % self.n_head == 0 and 0 < self.rotary_pct <= 1:
                    need(self.rotary_dim >= 2, f"rotary_pct {self.rotary_pct} of head dim {self.head_dim} rotates "
                                               f"{self.rotary_dim} features; at least 2 are needed")
        if self.position == "rotary" and self.rope_scaling is not None:
            try:
                rotary.rotary_table(0, max(self.rotary_dim, 4), 10000.0, scaling=self.rope_scaling)
            except (TypeError, ValueError) as exc:
                errors.append(f"rope_scaling: {exc}")
        for name in ("tie_embeddings", "bias", "scaled_init", "parallel_residual", "mask_padded_vocab",
                     "deterministic_attention"):
            need(isinstance(getattr(self, name), bool), f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.kernels, Mapping):
            errors.append(f"kernels must be a dict {{op: backend}}, got {self.kernels!r}")
        else:
            for op, backend in self.kernels.items():
                if op not in KERNEL_OPS:
                    errors.append(f"kernels: unknown op {op!r}; ops: {', '.join(KERNEL_OPS)}")
                elif backend not in megakern.op_backends(op):
                    errors.append(f"kernels: {op} has no backend {backend!r}; choose one of "
                                  f"{', '.join(sorted(megakern.op_backends(op)))}")
        need(self.ce_chunk is None or (isinstance(self.ce_chunk, int) and not isinstance(self.ce_chunk, bool)
                                       and self.ce_chunk >= 1), f"ce_chunk must be None or an int >= 1, got "
                                                                f"{self.ce_chunk!r}")
        if not errors:
            self._validate_moe(need)
        if errors:
            raise ValueError("GPTConfig: " + "; ".join(errors))
        return self

    def _validate_moe(self, need) -> None:
        def whole(name, low):
            value = getattr(self, name)
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
            need(ok, f"{name} must be an int >= {low}, got {value!r}")
            return ok

        def number(name, ok, what):
            value = getattr(self, name)
            good = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and ok(value)
            need(good, f"{name} must be {what}, got {value!r}")

        if not whole("n_experts", 0) or self.n_experts == 0:
            return
        e = self.n_experts
        ok = all([whole("moe_top_k", 1), whole("moe_every", 1), whole("moe_first_dense", 0),
                  whole("moe_shared_experts", 0), whole("moe_n_groups", 1), whole("moe_topk_groups", 1),
                  whole("moe_ffn_hidden", 1)])
        need(self.moe_router in ("softmax", "sigmoid"),
             f"moe_router must be 'softmax' or 'sigmoid', got {self.moe_router!r}")
        need(isinstance(self.moe_renormalize, bool), f"moe_renormalize must be a bool, got {self.moe_renormalize!r}")
        need(isinstance(self.moe_force_balance, bool),
             f"moe_force_balance must be a bool, got {self.moe_force_balance!r}")
        if self.moe_capacity_factor is not None:
            number("moe_capacity_factor", lambda v: v > 0, "None (dropless) or a number > 0")
        number("moe_aux_loss_coef", lambda v: v >= 0, "a number >= 0")
        number("moe_z_loss_coef", lambda v: v >= 0, "a number >= 0")
        number("moe_bias_update_rate", lambda v: v >= 0, "a number >= 0")
        if not ok:
            return
        need(self.moe_top_k <= e, f"moe_top_k ({self.moe_top_k}) must be <= n_experts ({e})")
        need(self.moe_first_dense < self.n_layer, f"moe_first_dense ({self.moe_first_dense}) leaves no MoE block "
                                                  f"among n_layer ({self.n_layer}) blocks")
        need(e % self.moe_n_groups == 0, f"moe_n_groups ({self.moe_n_groups}) must divide n_experts ({e})")
        need(self.moe_topk_groups <= self.moe_n_groups,
             f"moe_topk_groups ({self.moe_topk_groups}) must be <= moe_n_groups ({self.moe_n_groups})")
        if e % self.moe_n_groups == 0 and self.moe_topk_groups <= self.moe_n_groups:
            eligible = self.moe_topk_groups * (e // self.moe_n_groups)
            need(self.moe_top_k <= eligible, f"moe_top_k ({self.moe_top_k}) exceeds the {eligible} experts of "
                                             f"moe_topk_groups ({self.moe_topk_groups}) groups of "
                                             f"{e // self.moe_n_groups}")


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


_GPT2 = dict(norm="layernorm", position="learned", activation="gelu", bias=True, tie_embeddings=True,
             vocab_size=50304, norm_eps=1e-5)
_LLAMA = dict(norm="rmsnorm", position="rotary", activation="swiglu", bias=False, tie_embeddings=False,
              norm_eps=1e-5, rotary_base=500000.0)
PRESETS: dict[str, dict[str, Any]] = {
    # trains in minutes on 2 CPU cores on the default corpus (byte tokenizer: 257 ids)
    "gpt-tiny": dict(_GPT2, n_layer=4, n_embd=128, n_head=4, vocab_size=257, max_seqlen=256),
    "gpt-125m": dict(_GPT2, n_layer=12, n_embd=768, n_head=12, max_seqlen=1024),
    "gpt-350m": dict(_GPT2, n_layer=24, n_embd=1024, n_head=16, max_seqlen=1024),
    "gpt-1.3b": dict(_GPT2, n_layer=24, n_embd=2048, n_head=32, max_seqlen=2048),
    "llama-tiny": dict(_LLAMA, n_layer=4, n_embd=128, n_head=4, n_kv_head=2, vocab_size=257, max_seqlen=256,
                       rotary_base=10000.0),
    "llama-1b": dict(_LLAMA, n_layer=16, n_embd=2048, n_head=32, n_kv_head=8, ffn_hidden=8192, vocab_size=128256,
                     max_seqlen=8192, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192}),
    # Llama-3.1-8B's shape (32 layers; bench_train --n-layer takes a few of them onto one GPU)
    "llama-8b": dict(_LLAMA, n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, ffn_hidden=14336, vocab_size=128256,
                     max_seqlen=8192, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 8192}),
    # MoE: trains in minutes on 2 CPU cores on the default corpus (llama-tiny's attention, 8 experts, top-2)
    "moe-tiny": dict(_LLAMA, n_layer=4, n_embd=128, n_head=4, n_kv_head=2, vocab_size=257, max_seqlen=256,
                     rotary_base=10000.0, n_experts=8, moe_top_k=2, moe_ffn_hidden=128, moe_first_dense=1,
                     moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001),
    # Mixtral-style: 8 experts, top-2, softmax router, every block MoE; 1.6B parameters, 0.5B active (one GPU)
    "moe-mixtral": dict(_LLAMA, n_layer=16, n_embd=1024, n_head=16, n_kv_head=8, vocab_size=32000, max_seqlen=4096,
                        rotary_base=1e6, n_experts=8, moe_top_k=2, moe_ffn_hidden=3584, moe_renormalize=True,
                        moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001),
    # DeepSeek-style fine-grained: 64 experts, top-6, 2 shared, sigmoid router with the balancing bias, 8 groups of
    # which 4 eligible, the first block dense; 1.6B parameters, 0.3B active (one GPU)
    "moe-deepseek": dict(_LLAMA, n_layer=16, n_embd=1024, n_head=16, n_kv_head=16, vocab_size=32000,
                         max_seqlen=4096, ffn_hidden=4096, n_experts=64, moe_top_k=6, moe_ffn_hidden=512,
                         moe_shared_experts=2, moe_first_dense=1, moe_router="sigmoid", moe_renormalize=True,
                         moe_n_groups=8, moe_topk_groups=4, moe_aux_loss_coef=1e-4, moe_bias_update_rate=1e-3),
}


# ---- positions: computed once per forward, shared by every block ----------------------------------------------------
class Positions:
    """What the blocks of one forward need about token positions: the packing (cu_seqlens, max_seqlen) and, with
    rotary positions, the rotation (checked once, by the first block that rotates, then reused)."""

    def __init__(self, rope: Optional[megakern.RotaryEmbedding], rope_backend, cu_seqlens, max_seqlen,
                 position_ids):
        self.rope, self.rope_backend = rope, rope_backend
        self.cu_seqlens, self.max_seqlen, self.position_ids = cu_seqlens, max_seqlen, position_ids
        self._rotation = None  # (rotary.Rotation, the rotary backend's name)

    def rotation(self, q: torch.Tensor, k: torch.Tensor):
        if self._rotation is None:
            cos, sin = self.rope.table(q.device)
            if self.position_ids is not None:  # absolute positions (cu_seqlens, if any, only cuts attention)
                pos = self.position_ids.reshape(-1) if q.dim() == 3 else self.position_ids
                rot = rotary.check_inputs(q, k, cos, sin, self.rope.dim, False, None, pos, 0)
            else:
                rot = rotary.check_inputs(q, k, cos, sin, self.rope.dim, False, self.cu_seqlens, None, 0)
            self._rotation = rot, rotary.rotary_backend(q, self.rope_backend)
        return self._rotation


def _split_qkv(qkv: torch.Tensor, nkv: int, hs: int):
    """q (..., nh, hs), k, v (..., nkv, hs) from qkv (..., nkv, g + 2, hs); k and v are views, q is a view unless
    g > 1 and nkv > 1 (grouped-query attention), when its heads cannot be addressed by one stride."""
    g = qkv.shape[-2] - 2
    q = qkv[..., :g, :].reshape(*qkv.shape[:-3], nkv * g, hs)
    return q, qkv[..., g, :], qkv[..., g + 1, :]


def _split_heads_major(qkv: torch.Tensor, nkv: int):
    """q (..., nh, hs), k, v (..., nkv, hs), views of qkv (..., nh + 2 nkv, hs) in the heads-major order (see
    ``_HeadsMajor``)."""
    nh = qkv.shape[-2] - 2 * nkv
    return qkv[..., :nh, :], qkv[..., nh:nh + nkv, :], qkv[..., nh + nkv:, :]


class _HeadsMajor(torch.autograd.Function):
    """The fused qkv projection's weight (or bias), rows grouped per kv head as [g query heads, k, v] (the layout a
    tensor-parallel shard and the checkpoints keep), reordered for one product into [every query head, every k
    head, every v head]: q, k and v of that product are then views with one head stride each, so grouped-query
    attention needs no copy of q, and its backward writes the three gradients into one tensor (no concatenation).
    One pass over the weight each way (``megakern.qkv_rows``; the product's output is the same numbers, its columns
    reordered)."""

    @staticmethod
    def forward(ctx, w, nkv: int, g: int, hs: int, kernels):
        ctx.args = (nkv, g, hs)
        ctx.kernels = kernels
        return qkv_rows(w, nkv, g, hs, True, backend=kernels)

    @staticmethod
    def backward(ctx, grad):
        return qkv_rows(grad, *ctx.args, False, backend=ctx.kernels), None, None, None, None


class SplitRotate(torch.autograd.Function):
    """The fused projection qkv -> (q, k, v), q and k rotated in place by one launch of a rotary kernel (none with
    ``rot`` None). qkv is (..., nkv, g + 2, hs), the rows grouped per kv head, or with ``heads_major`` (..., nh + 2
    nkv, hs) (see ``_HeadsMajor``). Backward: the three gradients in one qkv-shaped tensor, the rotation undone in
    place. Where q, k and v are views (no grouped queries, or heads-major) megakern.attention's backward already
    writes them so (see ``megakern.attention.packed_qkv``); otherwise they are gathered by one concatenation.
    (Plain views under autograd would instead sum three zero-filled qkv-sized gradients.)"""

    @staticmethod
    def forward(ctx, qkv, nkv: int, hs: int, rot, backend, heads_major: bool = False):
        q, k, v = _split_heads_major(qkv, nkv) if heads_major else _split_qkv(qkv, nkv, hs)
        if rot is not None:
            rotary.rotate(q, k, rot, backend, inplace=True)
            torch.autograd.graph.increment_version(qkv)  # kernels wrote into qkv
        ctx.shape, ctx.nkv, ctx.hs, ctx.rot, ctx.backend = qkv.shape, nkv, hs, rot, backend
        ctx.heads_major, ctx.q_is_view = heads_major, q._base is not None
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        if ctx.rot is not None and not ctx.q_is_view:  # rotate back before the gather, q's gradient is separate
            dq, dk = rotary.rotate(dq, dk, ctx.rot, ctx.backend, conj=True)
        # attention wrote them into one tensor, laid out as its inputs were: as views of qkv
        packed = packed_qkv(dq, dk, dv)
        if packed is not None and packed.numel() == math.prod(ctx.shape):
            dqkv = packed.view(ctx.shape)
        elif ctx.heads_major:
            dqkv = torch.cat((dq, dk, dv), dim=-2)
        else:
            lead, g = ctx.shape[:-3], ctx.shape[-2] - 2
            dqkv = torch.cat((dq.reshape(*lead, ctx.nkv, g, ctx.hs), dk.reshape(*lead, ctx.nkv, 1, ctx.hs),
                              dv.reshape(*lead, ctx.nkv, 1, ctx.hs)), dim=-2)
        if ctx.rot is not None and ctx.q_is_view:
            q, k, _ = _split_heads_major(dqkv, ctx.nkv) if ctx.heads_major else _split_qkv(dqkv, ctx.nkv, ctx.hs)
            rotary.rotate(q, k, ctx.rot, ctx.backend, conj=True, inplace=True)
        return dqkv, None, None, None, None, None


def _project(layer: nn.Module, x: torch.Tensor, kernels) -> torch.Tensor:
    """``layer(x)``; a plain biased nn.Linear through megakern.linear (its bias gradient by a Triton column sum) where
    that backend is not the reference. Tensor-parallel and FP8 layers keep their own forward."""
    if type(layer) is nn.Linear and layer.bias is not None:
        return _project_weights(x, layer.weight, layer.bias, kernels)
    return layer(x)


def _project_weights(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], kernels) -> torch.Tensor:
    """x @ weight^T + bias, the bias through megakern.linear where that backend is not the reference."""
    if bias is not None and linear_backend(x, weight, kernels) != "torch":
        return megakern.linear(x, weight, bias, backend=kernels)
    return F.linear(x, weight, bias)


# ---- modules -------------------------------------------------------------------------------------------------------
class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(hs), causal) v by megakern.attention: ``core(q, k, v, *, cu_seqlens, max_seqlen)``,
    q (B, T, nh, hs), k / v (B, T, nkv, hs), or packed (total, heads, hs). Context parallelism replaces it."""

    def __init__(self, backend=None, deterministic: bool = True):
        super().__init__()
        self.backend, self.deterministic = backend, deterministic

    def forward(self, q, k, v, *, cu_seqlens=None, max_seqlen=None):
        return megakern.attention(q, k, v, causal=True, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                  backend=self.backend, deterministic=self.deterministic)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        hs = config.head_dim
        # rows grouped per kv head: [g query heads, k head, v head] for each kv head (a TP shard is one row block)
        qkv_bias = config.bias if config.qkv_bias is None else config.qkv_bias
        self.qkv = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_kv_head) * hs, bias=qkv_bias)
        self.proj = nn.Linear(config.n_head * hs, config.n_embd, bias=config.bias)
        self.core = AttentionCore(config.kernels, config.deterministic_attention)
        self.kernels = config.kernels
        self.recompute_core = config.recompute == "selective"
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor, pos: Positions) -> torch.Tensor:
        nkv, hs = self.n_kv_head, self.head_dim
        g = self.n_head // nkv
        # grouped queries: the product in the heads-major order, so that q is a view too (see _HeadsMajor); a
        # tensor-parallel or FP8 projection keeps its own forward and its output's grouped order
        heads_major = g > 1 and nkv > 1 and type(self.qkv) is nn.Linear
        if heads_major:
            w = _HeadsMajor.apply(self.qkv.weight, nkv, g, hs, self.kernels)
            b = None if self.qkv.bias is None else _HeadsMajor.apply(self.qkv.bias, nkv, g, hs, self.kernels)
            qkv = _project_weights(x, w, b, self.kernels)
        else:
            qkv = _project(self.qkv, x, self.kernels)
        # the sequence's length from the projection: a sequence-parallel qkv that gathers its input itself takes x's
        # shard and returns the whole sequence
        B, T = qkv.shape[0], qkv.shape[1]
        # (B, T, nkv, g + 2, hs) or heads-major (B, T, nh + 2 nkv, hs); (B * T, ...) when documents are packed
        heads = (self.n_head + 2 * nkv, hs) if heads_major else (nkv, g + 2, hs)
        qkv = qkv.view(B * T, *heads) if pos.cu_seqlens is not None else qkv.view(B, T, *heads)
        lead = qkv.shape[:-2] if heads_major else qkv.shape[:-3]
        rot, backend = None, None
        if pos.rope is not None:  # checked once per forward, on tensors of q's and k's shapes (no copies)
            k_view = qkv[..., self.n_head:self.n_head + nkv, :] if heads_major else qkv[..., g, :]
            rot, backend = pos.rotation(qkv.new_empty(()).expand(*lead, self.n_head, hs), k_view)
        if backend not in (None, "torch") and not torch.compiler.is_compiling():
            q, k, v = SplitRotate.apply(qkv, nkv, hs, rot, backend, heads_major)  # one launch, in place on the views
        else:
            q, k, v = SplitRotate.apply(qkv, nkv, hs, None, None, heads_major)
            # under autograd: the torch reference, or the kernels out of place when traced by torch.compile (an
            # in-place kernel on views is opaque to tracing)
            if rot is not None:
                q, k = rotary.apply_rotation(q, k, rot, backend)
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self.core, q, k, v, cu_seqlens=pos.cu_seqlens, max_seqlen=pos.max_seqlen,
                             use_reentrant=False)
        else:
            out = self.core(q, k, v, cu_seqlens=pos.cu_seqlens, max_seqlen=pos.max_seqlen)
        out = _project(self.proj, out.reshape(B, T, self.n_head * hs), self.kernels)
        return F.dropout(out, self.dropout, self.training) if self.dropout else out


class MLP(nn.Module):
    """The dense MLP (``hidden``: its units, default config.ffn_hidden; ``dropout``: on its output, default
    config.dropout)."""

    def __init__(self, config: GPTConfig, hidden: Optional[int] = None, dropout: Optional[float] = None):
        super().__init__()
        hidden = config.ffn_hidden if hidden is None else hidden
        self.swiglu = config.activation == "swiglu"
        self.gelu_exact = config.activation == "gelu_exact"
        # swiglu: rows interleaved per unit, 2i the gate and 2i + 1 the up projection of unit i
        self.fc = nn.Linear(config.n_embd, hidden * (2 if self.swiglu else 1), bias=config.bias)
        self.proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = config.dropout if dropout is None else dropout
        self.kernels = config.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            h = megakern.swiglu(self.fc(x), backend=self.kernels)
        elif self.gelu_exact:  # (megakern.bias_gelu is the tanh approximation)
            h = F.gelu(self.fc(x))
        elif bias_gelu_backend(x, self.kernels) == "torch":
            h = F.gelu(self.fc(x), approximate="tanh")
        elif self.fc.bias is None:
            h = megakern.bias_gelu(self.fc(x), None, backend=self.kernels)
        elif type(self.fc) is nn.Linear or hasattr(self.fc, "product"):
            # the bias rides in the activation's pass; its gradient comes out of the GELU backward's pass (a
            # tensor-parallel fc gives its product without the bias: ColumnParallelLinear.product)
            product = F.linear(x, self.fc.weight) if type(self.fc) is nn.Linear else self.fc.product(x)
            h = megakern.bias_gelu(product, self.fc.bias, backend=self.kernels)
        else:
            h = F.gelu(self.fc(x), approximate="tanh")
        out = _project(self.proj, h, self.kernels)
        return F.dropout(out, self.dropout, self.training) if self.dropout else out


def _norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return megakern.RMSNorm(config.n_embd, config.norm_eps, backend=config.kernels)
    return megakern.LayerNorm(config.n_embd, config.norm_eps, bias=config.bias, backend=config.kernels)


class Block(nn.Module):
    """Pre-norm transformer block over (x, h): x the last branch's output, h the residual stream before it (None in
    the first block); returns the same pair, so the next norm adds the residual in its own pass. With
    ``config.parallel_residual`` the returned x is the sum of both branches' outputs, each computed from h."""

    def __init__(self, config: GPTConfig, index: int = 0):
        super().__init__()
        self.parallel_residual = config.parallel_residual
        self.attn_norm = _norm(config)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = _norm(config)
        if config.is_moe_block(index):
            shared = (MLP(config, config.moe_shared_experts * config.moe_ffn_hidden, dropout=0.0)
                      if config.moe_shared_experts else None)
            self.mlp = MoEMLP(config, shared, row=config.moe_blocks.index(index))
        else:
            self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], pos: Optional[Positions], attend=None):
        """``attend(y)``: computes the attention of the normed input instead of ``self.attn(y, pos)`` (the KV-cache
        generation's step, models/generate.py)."""
        if residual is None:
            y, residual = self.attn_norm(x), x
        else:
            y, residual = self.attn_norm(x, residual)
        x = self.attn(y, pos) if attend is None else attend(y)
        if self.parallel_residual:  # both branches read h; the next norm adds their sum to it
            return x + self.mlp(self.mlp_norm(residual)), residual
        y, residual = self.mlp_norm(x, residual)
        return self.mlp(y), residual


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        config.validate()
        self.config = config
        with torch.device("meta"):  # built without memory; materialized and initialized once, below
            self.wte = nn.Embedding(config.padded_vocab, config.n_embd)
            self.wpe = nn.Embedding(config.max_seqlen, config.n_embd) if config.position == "learned" else None
            self.blocks = nn.ModuleDict({str(i): Block(config, i) for i in range(config.n_layer)})
            self.norm_f = _norm(config)
            self.lm_head = None if config.tie_embeddings else nn.Linear(config.n_embd, config.padded_vocab,
                                                                       bias=False)
        self.rope = (megakern.RotaryEmbedding(config.rotary_dim, config.max_seqlen, config.rotary_base,
                                              scaling=config.rope_scaling, backend=config.kernels)
                     if config.position == "rotary" else None)
        # the loss of a head whose vocabulary is split over ranks: loss(x (N, C), weight shard, targets (N,), **kw),
        # as megakern.linear_cross_entropy's keywords (tensor parallelism sets it; None: the whole vocabulary here)
        self.vocab_parallel_loss = None
        # learned positions as one table row per token, (B, T, C), instead of a (T, C) table broadcast over the batch
        # (a sequence-parallel plan that splits the tokens over ranks needs each token's own row)
        self.positions_per_token = False
        device = torch.get_default_device()
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()

    @classmethod
    def from_state(cls, config: GPTConfig, state: dict, *, dtype: Optional[torch.dtype] = None,
                   device="cpu") -> "GPT":
        """A GPT of ``config`` holding ``state`` (the whole model's tensors in its names: every one, no other), in
        ``dtype`` (default: the tensors') on ``device``; built on the meta device, nothing initialized twice."""
        with torch.device("meta"):
            model = cls(config)
        dtype = dtype or next(iter(state.values())).dtype
        model.to_empty(device=device)
        model.to(dtype)
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
        return model

    # -- parameters --
    def output_weight(self) -> torch.Tensor:
        """The (V, C) output projection: lm_head's weight, or wte's when tied."""
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def init_weights(self, generator: Optional[torch.Generator] = None) -> None:
        """(Re)initialize every parameter in place: embeddings and linear weights normal(0, init_std), output
        projections (attn.proj, mlp.proj) normal(0, init_std / sqrt(2 n_layer)) with scaled_init, biases 0, norm
        weights 1. Each parameter draws from its own generator seeded by one draw from ``generator`` (default: the
        global RNG) and a hash of its name, so a pipeline stage holding some blocks initializes them exactly as the
        whole model does."""
        config = self.config
        base = int(torch.randint(0, 2**62, (1,), generator=generator,
                                 device=generator.device if generator is not None else "cpu").item())
        out_std = config.init_std / math.sqrt(2 * config.n_layer) if config.scaled_init else config.init_std
        for name, p in self.named_parameters():
            if p.is_meta:
                raise RuntimeError(f"GPT.init_weights: {name} is on the meta device; call model.to_empty(device=...) "
                                   "first")
            owner, leaf = name.rsplit(".", 1)
            if owner.rsplit(".", 1)[-1] in ("attn_norm", "mlp_norm", "norm_f"):
                p.fill_(1.0 if leaf == "weight" else 0.0)
            elif leaf == "bias":
                p.zero_()
            else:
                std = out_std if name.endswith(OUTPUT_PROJECTIONS) else config.init_std
                gen = torch.Generator(device=p.device)
                gen.manual_seed((base ^ zlib.crc32(name.encode())) & (2**63 - 1))
                p.normal_(0.0, std, generator=gen)
        if isinstance(self, nn.Module):  # (megakern.parallel initializes shards through a stand-in: it calls this)
            self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Zero the persistent buffers that are state, not parameters: the sigmoid routers' balancing biases."""
        for module in self.modules():
            if isinstance(module, MoEMLP) and module.router.expert_bias is not None:
                module.router.expert_bias.zero_()

    # -- mixture of experts --
    def moe_layers(self) -> list[MoEMLP]:
        """This model's (or stage's) MoE MLPs, in block order."""
        return [b.mlp for b in self.blocks.values() if isinstance(b.mlp, MoEMLP)]

    def set_aux_loss_scale(self, scale: float) -> None:
        """The gradient each MoE layer's aux + z loss gets per micro-batch (the training step sets it: see
        megakern.parallel.ParallelModel.forward_backward); 1.0 until set."""
        for layer in self.moe_layers():
            layer.aux_loss_scale = float(scale)

    def track_moe_statistics(self, stats: Optional[torch.Tensor]) -> None:
        """Each MoE layer adds its training micro-batches' statistics to its row of ``stats`` (len(config.moe_blocks),
        moe_statistics_width) fp32 (models/moe.py); None stops it."""
        if stats is not None and tuple(stats.shape) != (len(self.config.moe_blocks), self.moe_statistics_width):
            raise ValueError(f"GPT.track_moe_statistics: want a ({len(self.config.moe_blocks)}, "
                             f"{self.moe_statistics_width}) tensor, got {tuple(stats.shape)}")
        for layer in self.moe_layers():
            layer.track_statistics(stats)

    @torch.no_grad()
    def discard_moe_statistics(self) -> None:
        """Zero this model's (or stage's) MoE layers' rows of the statistics (e.g. what a pipeline's shape inference
        added)."""
        for layer in self.moe_layers():
            if layer.stats is not None:
                layer.stats[layer.row].zero_()

    @property
    def moe_statistics_width(self) -> int:
        return stat_width(self.config.n_experts) if self.config.n_experts else 0

    def update_expert_bias(self, loads: torch.Tensor, skip: Optional[torch.Tensor] = None) -> None:
        """Once per optimizer step: each sigmoid router's bias from its row of ``loads`` (len(config.moe_blocks), E)
        (tokens routed per expert over the step, every micro-batch and data-parallel rank); ``skip`` (device bool)
        leaves them all unchanged."""
        for layer in self.moe_layers():
            layer.update_bias(loads[layer.row], skip)

    def num_params(self, exclude_embeddings: bool = False, active: bool = False) -> int:
        """Parameters (each once, tied weights too); ``exclude_embeddings``: without wte and wpe (lm_head, when
        untied, is counted); ``active``: the routed experts counted k of E (the parameters one token uses)."""
        skip = {id(m.weight) for m in (self.wte, self.wpe) if m is not None} if exclude_embeddings else set()
        seen, total = set(), 0
        for p in self.parameters():
            if id(p) not in seen and id(p) not in skip:
                seen.add(id(p))
                total += p.numel()
        if active:
            for layer in self.moe_layers():
                for w in (layer.w_in, layer.w_out):
                    total -= w.numel() * (layer.n_experts - layer.top_k) // layer.n_experts
        return total

    def flops_per_token(self, seqlen: int) -> float:
        """Training FLOPs per token (forward + backward), the MFU numerator (PaLM's convention): 6 N for the matmul
        weights N a token uses (every block's linears, the MoE routers, shared experts and k of E routed experts, and
        the output projection, tied or not) plus 12 * n_layer * nh * hs * seqlen for attention's two matmuls (full,
        not halved for the causal mask, as commonly reported)."""
        c = self.config
        n = (self.num_params(exclude_embeddings=True, active=True)
             + (c.padded_vocab * c.n_embd if self.lm_head is None else 0))
        return 6.0 * n + 12.0 * c.n_layer * c.n_head * c.head_dim * seqlen

    # -- forward --
    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, *,
                cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                position_ids: Optional[torch.Tensor] = None, reduction: str = "mean", check_values: bool = True,
                grad_scale: Optional[torch.Tensor] = None):
        """idx (B, T) int64 token ids (or, for a pipeline stage without wte, the hidden state (B, T, C)).

        Returns logits (B, T, padded_vocab) without ``targets``, else the cross-entropy of ``targets`` (B, T) int64
        (ignore_index -100; ``reduction`` "mean" | "sum"). A stage without norm_f returns the hidden state (B, T, C).
        ``cu_seqlens`` (ndocs + 1,) int32 offsets of packed documents in the B * T tokens, ``max_seqlen`` their
        longest length (computed when None); ``position_ids`` (B, T) or (T,) explicit positions.
        ``check_values`` False skips the checks that read device memory, one host-device sync each: the targets'
        range, the position ids' range and, given ``max_seqlen``, cu_seqlens' offsets (for callers whose data
        pipeline made and checked them, as the training program's does; shapes and dtypes are always checked).
        ``grad_scale``: with ``targets``, the gradient the loss's backward will receive, as
        ``megakern.linear_cross_entropy`` takes it (the one-process head; the vocab-parallel loss takes its gradient
        as it comes).
        """
        config = self.config
        B, T = self._check_inputs(idx, targets, cu_seqlens, position_ids, check_values)
        if grad_scale is not None and targets is None:
            raise ValueError("GPT: grad_scale is the loss's incoming gradient; it needs targets")
        if cu_seqlens is not None:
            # the caller's max_seqlen is taken on trust without check_values (reading cu_seqlens waits for the GPU)
            longest = (max(document_lengths("GPT", cu_seqlens, B * T)) if check_values or max_seqlen is None
                       else max_seqlen)
            # with explicit positions (context parallel's THD layout, a pipeline's final pad document) the positions'
            # range is what the tables see, not the local documents' lengths
            if longest > config.max_seqlen and position_ids is None:
                raise ValueError(f"GPT: a packed document has {longest} tokens; max_seqlen is {config.max_seqlen}")
            max_seqlen = longest if max_seqlen is None else max_seqlen
        device = idx.device
        if self.wte is not None:
            x = self._embed(idx)  # (B, T, C)
            if self.wpe is not None:
                positions = self._learned_positions(B, T, cu_seqlens, position_ids, device)
                x = x + self.wpe(positions.expand(B, T) if self.positions_per_token else positions)
            if config.dropout:
                x = F.dropout(x, config.dropout, self.training)
        else:
            x = idx
        pos = Positions(self.rope, config.kernels, cu_seqlens, max_seqlen, position_ids)
        x, residual = x, None
        for block in self.blocks.values():
            if config.recompute == "full" and torch.is_grad_enabled():
                x, residual = checkpoint(block, x, residual, pos, use_reentrant=False)
            else:
                x, residual = block(x, residual, pos)
        if self.norm_f is None:  # a pipeline stage: the residual stream goes on
            return x if residual is None else x + residual
        y = self.norm_f(x) if residual is None else self.norm_f(x, residual)[0]
        weight = self.output_weight()
        if targets is None:
            return F.linear(y, weight)
        y = y.reshape(-1, y.shape[-1])  # (B * T, C): T the whole sequence (a stage's input may be a shard of it)
        if y.shape[0] != targets.numel():
            raise ValueError(f"GPT: the head sees {y.shape[0]} tokens, targets hold {targets.numel()}")
        common = dict(ignore_index=IGNORE_INDEX, reduction=reduction, chunk_size=config.ce_chunk,
                      backend=config.kernels, check_targets=check_values)
        masked = config.mask_padded_vocab and config.padded_vocab != config.vocab_size
        if self.vocab_parallel_loss is not None:  # this rank's vocabulary shard; the padding is in the last one
            return self.vocab_parallel_loss(y, weight, targets.reshape(-1), **common,
                                            vocab_size=config.vocab_size if masked else None)
        # one process: the real vocabulary's rows of the head, a view (their gradient flows into the padded weight)
        return linear_cross_entropy(y, weight[:config.vocab_size] if masked else weight, targets.reshape(-1), **common,
                                    grad_scale=grad_scale)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, eos_id=None,
                 top_p: Optional[float] = None) -> torch.Tensor:
        """idx (B, T) -> (B, T + n) with a preallocated KV cache; see megakern.models.generate."""
        from megakern.models.generate import generate

        return generate(self, idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator,
                        eos_id=eos_id, top_p=top_p)

    def _check_inputs(self, idx, targets, cu_seqlens, position_ids, check_values: bool = True) -> tuple[int, int]:
        config = self.config
        if self.wte is not None:
            if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"GPT: idx must be a (B, T) int64 tensor of token ids, got "
                                 f"{_describe(idx)}")
        elif not isinstance(idx, torch.Tensor) or idx.dim() != 3 or idx.shape[-1] != config.n_embd:
            raise ValueError(f"GPT: this stage has no embedding; its input is the hidden state (B, T, "
                             f"{config.n_embd}), got {_describe(idx)}")
        B, T = idx.shape[:2]
        if cu_seqlens is None and T > config.max_seqlen:
            raise ValueError(f"GPT: sequence length {T} exceeds max_seqlen {config.max_seqlen}")
        if targets is not None:
            # a stage without wte may receive a sequence shard of the hidden state (sequence parallel, gathered by
            # the final norm's hook before the head): its targets cover the whole sequence, a multiple of T
            Tt = targets.shape[-1] if isinstance(targets, torch.Tensor) and targets.dim() == 2 else -1
            whole = self.wte is None and Tt > 0 and Tt % T == 0
            if (not isinstance(targets, torch.Tensor) or targets.shape != (B, Tt if whole else T)
                    or targets.dtype not in (torch.int64, torch.int32)):
                raise ValueError(f"GPT: targets must be a ({B}, {T}) int64 tensor like idx, got {_describe(targets)}")
            if targets.device != idx.device:
                raise ValueError(f"GPT: targets are on {targets.device} but idx is on {idx.device}")
        # cu_seqlens with position_ids: the positions are absolute within their documents (context parallel's
        # shards of documents); cu_seqlens then only cuts attention into documents
        if position_ids is not None:
            # a stage without wte may receive a sequence shard (B, T / n, C) of the hidden state (sequence parallel)
            # while position_ids cover the whole local sequence its attention sees: any multiple of T there
            L = position_ids.shape[-1] if isinstance(position_ids, torch.Tensor) and position_ids.dim() else -1
            if self.wte is not None or L < T or L % T:
                L = T
            if not isinstance(position_ids, torch.Tensor) or tuple(position_ids.shape) not in ((L,), (1, L), (B, L)):
                many = "" if self.wte is not None else " (this stage has no embedding: T' a multiple of T)"
                raise ValueError(f"GPT: position_ids must be (B, T) or (T,) with B={B}, T={T}{many}, got "
                                 f"{_describe(position_ids)}")
            if position_ids.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"GPT: position_ids must be int64 or int32, got {_describe(position_ids)}")
            if check_values and position_ids.numel():
                lo, hi = (int(v) for v in torch.aminmax(position_ids))
                if lo < 0 or hi >= config.max_seqlen:
                    raise ValueError(f"GPT: position_ids span {lo}..{hi}; positions must lie in 0..{config.max_seqlen - 1}"
                                     " (max_seqlen)")
        return B, T

    def _embed(self, idx: torch.Tensor) -> torch.Tensor:
        """wte's rows at idx through megakern.embedding (the table's gradient in one pass) where wte is a plain
        nn.Embedding of the lookup alone; a replaced one (tensor parallel's VocabParallelEmbedding) by its own
        forward."""
        wte = self.wte
        if type(wte) is nn.Embedding and wte.padding_idx is None and wte.max_norm is None and not (
                wte.scale_grad_by_freq or wte.sparse):
            return megakern.embedding(idx, wte.weight, backend=self.config.kernels)
        return wte(idx)

    @staticmethod
    def _learned_positions(B, T, cu_seqlens, position_ids, device) -> torch.Tensor:
        """Rows of wpe: (B, T) or broadcastable."""
        if position_ids is not None:
            return position_ids
        if cu_seqlens is not None:  # each document from 0
            t = torch.arange(B * T, device=device)
            doc = torch.searchsorted(cu_seqlens[1:].to(torch.int64), t, right=True)
            return (t - cu_seqlens.to(torch.int64)[doc]).view(B, T)
        return torch.arange(T, device=device)

    def extra_repr(self) -> str:
        c = self.config
        return (f"n_layer={c.n_layer}, n_embd={c.n_embd}, n_head={c.n_head}, n_kv_head={c.n_kv_head}, "
                f"vocab={c.vocab_size} (padded {c.padded_vocab}), params={self.num_params() / 1e6:.2f}M")


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {tuple(t.shape)} {t.dtype} tensor"
    return type(t).__name__
