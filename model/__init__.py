"""cp-train: the GPT model (config, blocks, FLOPs)."""

from model.config import ModelConfig, param_seed
from model.flops import matmul_params, model_flops_per_token
from model.gpt import GPTModel

__all__ = ["GPTModel", "ModelConfig", "matmul_params", "model_flops_per_token", "param_seed"]
