"""cp_train.model: the GPT model (the same function as Hugging Face Llama), its FLOPs and its HF weights.

Loaded lazily (see ``cp_train.parallel``); FSDP2 for this model is ``cp_train.model.parallelize``.
"""

from __future__ import annotations

from cp_train.lazy_exports import lazy_exports

_EXPORTS = {  # public name -> the module that defines it
    "GPTModel": "cp_train.model.gpt",
    "ModelConfig": "cp_train.model.config",
    "load_hf": "cp_train.model.hf.llama",
    "save_hf": "cp_train.model.hf.llama",
    "load_llama": "cp_train.model.hf.llama",
    "save_llama": "cp_train.model.hf.llama",
    "model_flops_per_token": "cp_train.model.family",
    "matmul_params": "cp_train.model.family",
    "ModelFamily": "cp_train.model.family",
    "register_model_family": "cp_train.model.family",
    "get_model_family": "cp_train.model.family",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
