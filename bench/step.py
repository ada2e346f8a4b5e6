"""One training step (forward, backward, AdamW) of the same Llama shape four ways, in one process on CPU.

    python -m bench.step [--hidden 512 --layers 6 --heads 8 --kv-heads 2 --vocab 32000 --seq 2048] [--rounds 5]
    python -m bench.step --tiny          # a small shape, for a smoke test

Variants: this model eager and compiled (``GPTModel.compile_parts``, as ``train.compile``), and transformers'
``LlamaForCausalLM`` (sdpa attention) eager and compiled, built from the same ``ModelConfig``
(``cp_train.model.hf.config.hf_config``). The variants take turns step by step after ``--warmup`` steps each
(compilation happens there), so drift on a shared machine hits them alike; a variant's time is the median
of its ``--rounds`` timed steps. Peak memory is the process's RSS high-water mark over each variant's steps
above the RSS before them (``bench.common``). The table gives each step time over this model's eager one.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/step.py` from anywhere

import torch  # noqa: E402

from bench.common import emit, median, peak_memory_mb, reset_peak_memory  # noqa: E402
from cp_train.model.config import ModelConfig  # noqa: E402
from cp_train.model.gpt import GPTModel  # noqa: E402
from cp_train.model.hf.config import hf_config  # noqa: E402

Step = Callable[[], None]


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(vocab_size=args.vocab, num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                       num_kv_heads=args.kv_heads, ffn_hidden_size=args.ffn or _ffn(args.hidden),
                       max_position_embeddings=args.seq, tie_embeddings=False)


def _ffn(hidden: int) -> int:
    """Llama's SwiGLU width: 8/3 of hidden, rounded up to a multiple of 64."""
    return -(-(8 * hidden // 3) // 64) * 64


def ours(config: ModelConfig, tokens: torch.Tensor, labels: torch.Tensor, compiled: bool) -> Step:
    model = GPTModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if compiled:
        model.compile_parts()  # what train.compile does: each block and the head with its loss

    def step() -> None:
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def llama_config(config: ModelConfig):  # noqa: ANN201 - transformers' LlamaConfig (imported here only)
    """transformers' ``LlamaConfig`` of the same model (``hf_config``'s fields)."""
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in hf_config(config).items() if k not in ("architectures", "torch_dtype")})


def transformers_llama(config: ModelConfig, tokens: torch.Tensor, labels: torch.Tensor, compiled: bool) -> Step:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM._from_config(llama_config(config), attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    call = torch.compile(model) if compiled else model

    def step() -> None:
        loss = call(input_ids=tokens, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


VARIANTS = {"ours eager": (ours, False), "ours compiled": (ours, True),
            "transformers eager": (transformers_llama, False), "transformers compiled": (transformers_llama, True)}


def run(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    config = model_config(args)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    labels = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    steps = {name: build(config, tokens, labels, compiled) for name, (build, compiled) in VARIANTS.items()
             if name in args.variants}
    times: dict[str, list[float]] = {name: [] for name in steps}
    peaks: dict[str, float] = {name: 0.0 for name in steps}
    for round_index in range(args.warmup + args.rounds):
        for name, step in steps.items():
            base = reset_peak_memory()
            start = time.perf_counter()
            step()
            seconds = time.perf_counter() - start
            peaks[name] = max(peaks[name], peak_memory_mb() - base)
            if round_index >= args.warmup:
                times[name].append(seconds)
    baseline = median(times[next(iter(steps))])
    return [{"variant": name, "hidden": config.hidden_size, "layers": config.num_layers, "heads": config.num_heads,
             "kv_heads": config.num_kv_heads, "vocab": config.vocab_size, "seq": args.seq, "batch": args.batch,
             "threads": torch.get_num_threads(), "step_ms": 1000 * median(seconds), "rounds": args.rounds,
             "vs_ours_eager": median(seconds) / baseline, "peak_mb": peaks[name]}
            for name, seconds in times.items()]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=None, help="default: 8/3 hidden, a multiple of 64")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--tiny", action="store_true", help="hidden 64, 2 layers, vocab 512, seq 128, 1 round")
    args = parser.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.heads, args.kv_heads, args.vocab, args.seq = 64, 2, 4, 2, 512, 128
        args.rounds, args.warmup = 1, 1
    records = run(args)
    emit(records, [("variant", "variant", str), ("seq", "seq", str), ("step_ms", "step ms", "{:.1f}".format),
                   ("vs_ours_eager", "vs ours eager", "{:.3f}".format), ("peak_mb", "peak MB", "{:.0f}".format)])
    return records


if __name__ == "__main__":
    main()
