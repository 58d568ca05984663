"""megakern: kernels for training transformers at scale, each tested against a torch reference.

Ops take ``backend=`` ('torch' | 'triton' | 'cuda', or a config's kernel table {op: backend}); see
``available_backends`` (what runs on a device) and ``op_backends`` (what each op offers).
"""
from megakern._backend import available_backends, op_backends
from megakern.activation import bias_gelu, bias_gelu_ref, swiglu, swiglu_ref
from megakern.attention import Attention, attention, attention_ref, merge_attention
from megakern._cuda import runtime as cuda_runtime
from megakern.cross_entropy import cross_entropy, cross_entropy_ref, linear_cross_entropy, linear_cross_entropy_ref
from megakern.embedding import embedding, embedding_grad, embedding_ref
from megakern.layernorm import LayerNorm, layer_norm, layer_norm_ref
from megakern.linear import linear
from megakern.qkv_order import qkv_rows, qkv_rows_ref
from megakern.rmsnorm import RMSNorm, rms_norm, rms_norm_ref
from megakern.rotary import RotaryEmbedding, apply_rotary, rotary_ref, rotary_table

__version__ = "0.1.0"

__all__ = [
    "Attention", "LayerNorm", "RMSNorm", "RotaryEmbedding", "apply_rotary", "attention", "attention_ref",
    "available_backends", "bias_gelu", "bias_gelu_ref", "cross_entropy", "cross_entropy_ref", "cuda_runtime",
    "embedding", "embedding_grad", "embedding_ref",
    "layer_norm", "layer_norm_ref", "linear", "linear_cross_entropy", "linear_cross_entropy_ref", "merge_attention",
    "op_backends", "qkv_rows", "qkv_rows_ref", "rms_norm", "rms_norm_ref", "rotary_ref", "rotary_table", "swiglu",
    "swiglu_ref",
]
