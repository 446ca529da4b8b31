"""Model implementations and weight loading (see docs/DESIGN.md, "Models")."""
from __future__ import annotations

import torch

from pagedbackend.models.llama import ARCHITECTURES, LlamaArgs, LlamaForCausalLM
from pagedbackend.models.loader import load_hf_config, load_weights


def build_model(hf_config: dict, dtype: torch.dtype, device: torch.device, attn_backend,
                tp_rank: int = 0, tp_size: int = 1, tp_group=None) -> LlamaForCausalLM:
    """An unloaded model (parameters allocated on `device`, values undefined) for one rank."""
    return LlamaForCausalLM(hf_config, dtype, torch.device(device), attn_backend,
                            tp_rank, tp_size, tp_group)


__all__ = ["ARCHITECTURES", "LlamaArgs", "LlamaForCausalLM", "build_model", "load_hf_config",
           "load_weights"]
