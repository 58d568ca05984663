"""megakern.data: raw text -> token files -> training samples, with every assumption checked.

tokenizers (byte, char, GPT-2 BPE, any tokenizer.json) -> preprocess (streaming, multiprocess:
``megakern.data.preprocess.preprocess`` and ``python -m megakern.data.preprocess``; sft: prompt/response and chat
examples, ``--format sft``) -> indexed (.bin/.idx with checksums, and .mask.bin, the loss mask of SFT data;
megatron: Megatron-LM's MMIDIDX files) -> gpt_dataset (deterministic sample indices, cached; windows of the
document stream or whole documents packed) -> blended (weighted mixes) -> sampler (resumable, data-parallel).
corpus: the default corpus that is always present (the Python standard library's sources), built into a cache on
first use. build: a run's train / held-out (or data.valid_paths) datasets (``build_data``); batch: samples -> device
micro-batches (``to_batch``), the targets the loss mask leaves out ignored.
"""
from megakern.data.batch import IGNORE_INDEX, Batch, document_offsets, targets_of, to_batch
from megakern.data.blended import BlendedDataset
from megakern.data.build import Data, DocumentSubset, build_data, split_documents
from megakern.data.corpus import ensure_default_dataset
from megakern.data.gpt_dataset import GPTDataset, build_indices
from megakern.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter, dtype_for_vocab
from megakern.data.megatron import MegatronIndexedDataset, is_megatron
from megakern.data.sampler import PretrainingSampler, build_dataloader, check_ranks_agree
from megakern.data.tokenizers import (ByteTokenizer, CharTokenizer, GPT2BPETokenizer, HFTokenizer, Tokenizer,
                                      load_tokenizer)

__all__ = [
    "IGNORE_INDEX", "Batch", "BlendedDataset", "ByteTokenizer", "CharTokenizer", "Data", "DataError", "DocumentSubset",
    "GPT2BPETokenizer", "GPTDataset", "HFTokenizer", "IndexedDataset", "IndexedDatasetWriter", "MegatronIndexedDataset",
    "PretrainingSampler", "Tokenizer", "build_data", "build_dataloader", "build_indices", "check_ranks_agree",
    "document_offsets", "dtype_for_vocab", "ensure_default_dataset", "is_megatron", "load_tokenizer",
    "split_documents", "targets_of", "to_batch",
]
