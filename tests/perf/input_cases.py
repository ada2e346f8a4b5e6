"""What the planner-input tests share: the repository's root, the published parameter counts, one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from cp_train.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
# published parameter counts (the model cards' / HF pages' rounding), the presets' checks
PUBLISHED_PARAMETERS: dict[str, float] = {
    "llama3-8b": 8.03e9,     # https://huggingface.co/meta-llama/Llama-3.1-8B ("8.03B params")
    "llama3-70b": 70.6e9,    # https://huggingface.co/meta-llama/Llama-3.1-70B ("70.6B params")
    "llama3-405b": 405.9e9,  # https://huggingface.co/meta-llama/Llama-3.1-405B (405,853,388,800 weights)
    "llama2-7b": 6.74e9,     # https://huggingface.co/meta-llama/Llama-2-7b-hf ("6.74B params")
    "qwen2.5-7b": 7.62e9,    # https://huggingface.co/Qwen/Qwen2.5-7B ("7.62B params", with the q/k/v biases)
}


def one_line_error(error: pytest.ExceptionInfo, *words: str) -> str:
    message = str(error.value)
    assert isinstance(error.value, InputError) and "\n" not in message and message
    for word in words:
        assert word in message, (word, message)
    return message
