"""cp-train: the GPT model (config, blocks, FLOPs)."""

from cp_train.model.config import ModelConfig, param_seed
from cp_train.model.flops import matmul_params, model_flops_per_token
from cp_train.model.gpt import GPTModel

__all__ = ["GPTModel", "ModelConfig", "matmul_params", "model_flops_per_token", "param_seed"]
