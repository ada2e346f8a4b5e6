"""``cp-train-plan`` (``python -m cp_train.perf``): predict what the layouts a model can train in will do on GPUs,
with the range measured runs like each came out in, before renting (``cp_train/perf``, docs/planner.md).

    cp-train-plan llama3-8b --seq-len 131072 --gpus 8 --hardware h100-sxm            # search: the best 10
    cp-train-plan llama3-8b --seq-len 131072 --gpus 8 --cp 4 --fsdp --explain          # one layout, in words
    cp-train-plan launch/configs/gpt-8b-128k-cp8.yaml --seq-len 131072 --gpus 8 --json
    cp-train-plan --calibrate gpu.yaml                                       # measure this machine's GPU

With no layout flag it searches every layout the trainer can run (``cp_train/perf/search.py``); any layout flag
fixes that setting. Prints a table, or one JSON line per layout (``--json``). Bad input is one line and exit
status 2. A search prints its progress on stderr every 5 s; ``--max-seconds S`` stops it with the best found.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import NoReturn

from cp_train.config.arg_types import OneLineParser, fraction, non_negative_float, positive_int
from cp_train.config.schema import Config, ConfigError
from cp_train.config.sources import load_config
from cp_train.errors import InputError, exit_now
from cp_train.memory.dry_run import RESERVE_FRACTION, RESERVE_GIB, checked_reserve_gib
from cp_train.parallel.cp.algorithms.registry import cp_algorithm_names
from cp_train.perf.explain import explain
from cp_train.perf.inputs.documents import document_pieces, parse_document_lengths
from cp_train.perf.inputs.hardware import load_hardware
from cp_train.perf.inputs.presets import load_model
from cp_train.perf.predict import Prediction
from cp_train.perf.rates import DeviceRates, linear_precision
from cp_train.perf.search import Choices, search


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="cp-train-plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a preset (llama3-8b, llama3-70b, llama3-405b, llama2-7b, qwen2.5-7b, "
                                      "gpt-1b, gpt-8b), a project YAML config or a Hugging Face config.json")
    parser.add_argument("--seq-len", type=positive_int, required=True, help="tokens per sample")
    parser.add_argument("--gpus", type=positive_int, required=True, help="GPUs in all")
    parser.add_argument("--gpus-per-node", type=positive_int, default=None, help="default: the hardware's (8)")
    parser.add_argument("--hardware", default="h100-sxm", help="h100-sxm, h100-sxm-96g, h200, b200, a100-80g, "
                                                               "h800, or a YAML file of constants")
    parser.add_argument("--global-batch-tokens", type=positive_int, default=None,
                        help="tokens per optimizer step (default: seq-len x gpus)")
    parser.add_argument("--document-lengths", default=None, metavar="N|N,N,...|FILE|PREFIX",
                        help="the lengths of the documents packed into each sample (one length, a comma list, a "
                             "file of lengths, or an indexed dataset's prefix); attention stays inside each "
                             "(default: one document per sample)")
    parser.add_argument("--vocab-size", type=positive_int, default=128256,
                        help="for a project YAML whose model.vocab_size is null (the tokenizer's); default 128256")
    parser.add_argument("--eager", action="store_true", help="plan the eager step (default: compiled, --compile)")
    parser.add_argument("--precision", choices=("bf16", "fp8", "tensorwise", "rowwise"), default=None,
                        help="the blocks' linears' precision, the trainer's model.fp8: bf16, or fp8 with a recipe "
                             "(fp8: tensorwise unless the config names one); default: the config's model.fp8")
    parser.add_argument("--attention-kernel", default=None, metavar="KERNEL",
                        help="the attention kernel planned, one of the profile's curves (cudnn, flash2; default: "
                             "the profile's, the trainer's choice on that GPU)")
    for flag in ("--tp", "--cp", "--dp", "--ulysses-size", "--mlp-chunks", "--micro-batch"):
        parser.add_argument(flag, type=positive_int, default=None)
    parser.add_argument("--cp-algorithm", choices=cp_algorithm_names(), default=None)
    parser.add_argument("--cp-layout", choices=("zigzag", "stripe", "contiguous", "balanced"), default=None,
                        help="balanced: with --document-lengths (it places tokens by their documents)")
    parser.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--activation-checkpointing", choices=("none", "selective", "full"), default=None)
    parser.add_argument("--reserve-gib", type=non_negative_float, default=RESERVE_GIB)
    parser.add_argument("--reserve-fraction", type=fraction, default=RESERVE_FRACTION)
    parser.add_argument("--top", type=positive_int, default=10, help="layouts shown by a search")
    parser.add_argument("--max-seconds", type=non_negative_float, default=None, metavar="S",
                        help="stop a search after S seconds with the best layouts found so far (it says so)")
    parser.add_argument("--json", action="store_true", help="one JSON line per layout instead of the table")
    parser.add_argument("--explain", action="store_true", help="the best layout's time and memory in words")
    parser.add_argument("--calibrate", metavar="OUT.yaml", default=None,
                        help="measure this machine's GPU (about a minute) and write a hardware profile for "
                             "--hardware OUT.yaml; no model or layout needed")
    parser.add_argument("--quick", action="store_true", help="with --calibrate: a few sizes only (seconds)")
    return parser


def _check_gpu_config(spec: str) -> None:
    """A project YAML config that runs on CPU ranks (gloo): one line saying the planner predicts GPUs."""
    if not spec.endswith((".yaml", ".yml")):
        return
    try:
        backend = load_config(spec).parallel.backend
    except ConfigError:
        return  # ``load_model`` says what is wrong with the file
    if backend == "gloo":
        raise InputError(f"{spec} runs on CPU ranks (parallel.backend gloo): cp-train-plan predicts GPUs; for its "
                         f"memory run train.py --config {spec} --dry-run")


def _linears(config: Config, precision: str) -> str:
    """How the blocks' linears are planned: ``bf16 linears``, ``fp8 linears`` or, with blocks kept out of FP8
    (``model.fp8_bf16_layers_at_start`` / ``_at_end``), which run in fp8."""
    blocks, layers = config.model.blocks_under_fp8, config.model.num_layers
    if precision != "fp8":
        return f"{precision} linears"
    fp8 = f"fp8 ({config.model.fp8}) linears"
    if len(blocks) == layers:
        return fp8
    return f"{fp8} in blocks {blocks.start}-{blocks.stop - 1} ({layers - len(blocks)} of {layers} in bf16)"


def base_config(args: argparse.Namespace) -> Config:
    """The run config every candidate starts from: the model, sequence and batch, on CUDA in bf16."""
    _check_gpu_config(args.model)
    config = Config()
    config.model = load_model(args.model, vocab_size=args.vocab_size)
    config.model.max_position_embeddings = max(config.model.max_position_embeddings, args.seq_len)
    config.data.seq_len = args.seq_len
    tokens = args.global_batch_tokens or args.seq_len * args.gpus
    if tokens % args.seq_len:
        raise InputError(f"--global-batch-tokens {tokens} is not a multiple of --seq-len {args.seq_len}")
    config.train.global_batch_size = tokens // args.seq_len
    config.train.dtype = "bf16"
    config.train.compile = not args.eager
    config.parallel.backend = None  # CUDA: the dry run plans nccl runs
    config.logging.wandb = False
    if args.precision == "bf16":  # --precision and model.fp8 are one switch: the config plans what it trains
        config.model.fp8 = "none"
    elif args.precision == "fp8" and config.model.fp8 == "none":
        config.model.fp8 = "tensorwise"
    elif args.precision in ("tensorwise", "rowwise"):
        config.model.fp8 = args.precision
    return config


def choices_of(args: argparse.Namespace) -> Choices:
    """The search space, with each given flag fixing its setting."""
    def fixed(value: object) -> tuple | None:
        return None if value is None else (value,)
    algorithm = args.cp_algorithm or ("hybrid" if args.ulysses_size else None)
    return Choices(tp=fixed(args.tp), cp=fixed(args.cp), dp=fixed(args.dp),
                   algorithms=fixed(algorithm) or Choices.algorithms, layouts=fixed(args.cp_layout),
                   fsdp=fixed(args.fsdp) or Choices.fsdp,
                   checkpointing=fixed(args.activation_checkpointing) or Choices.checkpointing,
                   mlp_chunks=fixed(args.mlp_chunks), micro_batches=fixed(args.micro_batch),
                   ulysses=fixed(args.ulysses_size))


def table(predictions: list[Prediction]) -> str:
    header = ("#", "tp", "cp", "dp", "cp algorithm", "layout", "fsdp", "ckpt", "mlp", "mb", "step s", "tok/s/GPU",
              "range", "TFLOP/s half|full", "range (half)", "MFU half|full", "GiB", "fits")
    rows = [header]
    for index, p in enumerate(predictions, 1):
        r = p.record()
        algorithm = r["cp_algorithm"] + (f" u{r['ulysses_size']}" if r["ulysses_size"] else "") if r["cp"] > 1 else "-"
        rows.append((str(index), str(r["tp"]), str(r["cp"]), str(r["dp"]), algorithm, r["cp_layout"] if r["cp"] > 1
                     else "-", "yes" if r["fsdp"] else "no", r["activation_checkpointing"], str(r["mlp_chunks"]),
                     str(r["micro_batch"]), f"{r['step_time_s']:.3g}", f"{r['tokens_per_s_per_gpu']:,.0f}",
                     "{:,.0f}-{:,.0f}".format(*r["tokens_per_s_per_gpu_range"]),
                     "{:.0f} | {:.0f}".format(*r["tflops_per_gpu"].values()),
                     "{:.0f}-{:.0f}".format(*r["tflops_per_gpu_range"]["causal_half"]),
                     "{:.1%} | {:.1%}".format(*r["mfu"].values()), f"{r['memory_gib']['total']:.3g}",
                     "yes" if r["fits"] else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)


def _documents_note(documents: tuple[int, ...], seq_len: int) -> str:
    pieces = document_pieces(documents, seq_len)
    return f"; {len(pieces)} documents per sample (mean {seq_len / len(pieces):,.0f} tokens)"


def calibrate_main(path: str, quick: bool) -> int:
    """``--calibrate OUT.yaml``: measure this GPU, print each measurement, write the profile."""
    from cp_train.perf.calibrate import write_profile

    try:
        write_profile(path, quick, log=lambda line: print(line, flush=True))
    except (OSError, InputError) as error:
        print(f"cp-train-plan: {error}" if isinstance(error, InputError) else
              f"cp-train-plan: cannot write {path}: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}: use it with --hardware {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--calibrate")
    pre.add_argument("--quick", action="store_true")
    early, _ = pre.parse_known_args(argv)
    if early.calibrate:
        return calibrate_main(early.calibrate, early.quick)
    try:
        args = build_parser().parse_args(argv)
        hardware = load_hardware(args.hardware)
        if args.gpus_per_node:
            hardware = dataclasses.replace(hardware, gpus_per_node=args.gpus_per_node)
        base = base_config(args)
        precision = linear_precision(base.model.fp8)
        rates = DeviceRates(hardware, precision, args.attention_kernel)
        reserve = checked_reserve_gib(hardware.hbm_gib, args.reserve_gib, args.reserve_fraction, hardware.name)
        documents = parse_document_lengths(args.document_lengths) if args.document_lengths else None
        result = search(base, args.gpus, rates, hardware.peak_tflops("bf16"), hardware.hbm_gib, reserve,
                        choices_of(args), documents, keep=max(1, args.top), max_seconds=args.max_seconds,
                        progress=lambda r: print(f"cp-train-plan: {r.progress_line()}", file=sys.stderr, flush=True))
    except InputError as error:
        print(f"cp-train-plan: {error}", file=sys.stderr)
        return 2
    if result.stopped:
        print(f"cp-train-plan: stopped by --max-seconds {args.max_seconds:g}: {result.evaluated:,} of "
              f"{result.total:,} layouts searched; the best found so far follow", file=sys.stderr, flush=True)
    if not result.ranked:
        reasons = "; ".join(f"{reason} ({count}x)" for reason, count in result.rejected.most_common(3)) or (
            "none was predicted before the time limit: raise --max-seconds" if result.stopped else
            f"--tp/--cp/--dp as given leave no tp*cp*dp = {args.gpus} (--gpus): change them")
        print(f"cp-train-plan: no layout the trainer can run: {reasons}", file=sys.stderr)
        return 2
    shown = result.ranked[: max(1, args.top)]
    if args.json:
        for prediction in shown:
            print(json.dumps(prediction.record()))
    else:
        documents_note = _documents_note(documents, args.seq_len) if documents else ""
        print(f"{base.model.num_layers} layers x {base.model.hidden_size} hidden, seq {args.seq_len:,}, "
              f"{args.gpus} x {hardware.name}, {base.train.global_batch_size} samples per step, "
              f"{_linears(base, precision)}, {rates.kernel} attention: {result.summary()}{documents_note}")
        print(table(shown))
        print(f"range: the planner's errors on the {len(shown[0].band.runs)} measured runs of regime "
              f"{'/'.join(shown[0].band.regime)} (cp_train/perf/ranges.py; --explain names them)")
    if args.explain:
        print(explain(shown[0], hardware))
    return 0


def console_main() -> NoReturn:
    """The ``cp-train-plan`` console script: ``main``, then the end of the process (``exit_now``: without the
    interpreter's teardown of the modules)."""
    exit_now(main())


if __name__ == "__main__":
    console_main()
