"""The small config the config tests build (``small``) and the shipped configs' folder."""

from __future__ import annotations

from pathlib import Path

from cp_train.config.schema import Config
from cp_train.config.sources import build_config

CONFIGS = Path(__file__).resolve().parents[2] / "launch" / "configs"
SMALL_MODEL = {"model.vocab_size": 256, "model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4,
               "model.num_kv_heads": 2, "model.ffn_hidden_size": 128, "model.max_position_embeddings": 256}


def small(**overrides) -> Config:
    values = {**SMALL_MODEL, "data.seq_len": 64, "train.global_batch_size": 8, "train.micro_batch_size": 2,
              "parallel.cp": 2}
    values.update(overrides)
    return build_config([("test", values)])
