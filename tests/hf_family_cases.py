"""Hugging Face Mistral, Qwen2, Qwen3 and granite_swa test cases: random tiny transformers models built in code
(every parameter random, biases and sinks included) and the rank-side check that loads them at a layout.

The reference is transformers' own model of each family in fp32; nothing comes from the hub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cp_train.model.gpt import GPTModel
from cp_train.model.hf.llama import load_hf
from cp_train.parallel.cp.layout import gather_sequence, shard_sequence
from cp_train.parallel.mesh.state import ParallelState
from tests import hf_cases

SEQ = 64  # tokens per sample: divides by 2*cp at cp 4 and by tp*cp; windows below are shorter
WINDOW = 12
BASE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "initializer_range": 0.1,
        "max_position_embeddings": SEQ, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0}
ALTERNATING = ["sliding_attention", "full_attention"]
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (transformers class, config overrides)
    "llama bias head_dim tied": ("Llama", {"attention_bias": True, "head_dim": 24, "tie_word_embeddings": True}),
    "mistral window untied": ("Mistral", {"sliding_window": WINDOW, "head_dim": 8}),
    "mistral no window tied": ("Mistral", {"sliding_window": None, "tie_word_embeddings": True}),
    "qwen2 window untied": ("Qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
                                      "rope_theta": 1e6}),
    "qwen2 released tied": ("Qwen2", {"use_sliding_window": False, "sliding_window": 32768,
                                      "tie_word_embeddings": True}),
    "qwen3 head_dim untied": ("Qwen3", {"head_dim": 24, "num_key_value_heads": 4}),
    "qwen3 window bias tied": ("Qwen3", {"head_dim": 8, "attention_bias": True, "use_sliding_window": True,
                                         "sliding_window": WINDOW, "layer_types": ALTERNATING,
                                         "tie_word_embeddings": True}),
    "granite sinks untied": ("GraniteSWA", {"sliding_window": WINDOW, "layer_types": ALTERNATING,
                                            "attention_multiplier": 16**-0.5, "tie_word_embeddings": False}),
}
RELEASED_QWEN2 = {"sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 21}  # as Qwen2.5 ship
WINDOWED = {name for name, (_, o) in VARIANTS.items() if o.get("use_sliding_window", True) and o.get("sliding_window")}


def make_hf_model(path: Path, family: str, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers model of ``family`` (every norm weight, bias and sink random too) saved to ``path``;
    returns the fp32 model. The Qwen2 "released" config is rewritten as Qwen2.5's config.json ships."""
    import transformers

    config = getattr(transformers, f"{family}Config")(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
            elif name.endswith("bias") or name.endswith("sinks"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    if overrides.get("sliding_window") == 32768:
        hf = json.loads((path / "config.json").read_text())
        hf.pop("layer_types", None)
        (path / "config.json").write_text(json.dumps({**hf, **RELEASED_QWEN2}, indent=2))
    return model


def build_all(root: Path, tokens: torch.Tensor, names: list[str] | None = None) -> tuple[dict, dict]:
    """``({name: path}, {name: transformers' logits and loss})`` of every variant (or ``names``)."""
    paths, refs = {}, {}
    for i, name in enumerate(names or VARIANTS):
        family, overrides = VARIANTS[name]
        path = root / name.replace(" ", "-")
        model = make_hf_model(path, family, seed=10 + i, **overrides)
        paths[name], refs[name] = str(path), hf_cases.hf_reference(model, tokens)
    return paths, refs


def full_logits(model: GPTModel, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Logits ``[B, S, V]`` of the global ``tokens`` (gathered over TP and CP; one forward) and their mean
    next-token loss (computed here from them: ``hf_cases.full_logits_and_loss`` checks the model's fused loss)."""
    p = model.parallel
    with torch.no_grad():
        logits = hf_cases.tp_gather_last(model(shard_sequence(tokens, p.cp_rank, p.cp_size, p.layout)), p.tp_group)
    if p.cp_size > 1:
        logits = gather_sequence(logits, p.cp.cp, p.layout)
    loss = F.cross_entropy(logits.double().flatten(0, 1), hf_cases.next_token_labels(tokens).flatten())
    return {"logits": logits, "loss": loss}


def logits_at_layouts(state: ParallelState, layouts: list[tuple], paths: dict[str, str],
                      tokens: torch.Tensor) -> dict[str, Any]:
    """``{f"{layout} {algorithm} sp={sp} {name}": full logits and loss}`` of every model loaded at this state's
    (tp, cp) in each ``(layout, algorithm, sequence_parallel[, only these names])``."""
    results = {}
    for layout, algorithm, sp, *only in layouts:
        for name, path in paths.items():
            if not only or name in only[0]:
                model = load_hf(path, state.model_parallel(layout, algorithm, sp))
                results[f"{layout} {algorithm} sp={sp} {name}"] = full_logits(model, tokens)
    return results
