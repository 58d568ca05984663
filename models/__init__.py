"""megakern.models: GPT and MoE models assembled from megakern's kernels.

Installed as ``megakern.models`` (the source folder is models/), so no top-level ``models`` package is installed.
"""
from megakern.models.gpt import GPT, PRESETS, GPTConfig
from megakern.models.moe import MoEMLP

__all__ = ["GPT", "GPTConfig", "MoEMLP", "PRESETS"]  # generation: GPT.generate, or megakern.models.generate.generate
