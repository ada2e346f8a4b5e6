"""Published measurements the planner is checked against, one ``PublishedRun`` per table row, as the source
states them (numbers quoted, not the prose). Only runs without pipeline parallelism (the trainer has none).

Fields a source leaves unstated are None (``activation_checkpointing``: "unknown"); ``notes`` says where a
value comes from elsewhere (a default config at the stated commit). ``dp`` is the source's data-parallel
degree (FSDP shards count there); ``fsdp`` says whether parameters are sharded over it (torchtitan shards over
dp x cp). ``seq_len`` may exceed the preset's ``max_position_embeddings`` (those runs extended RoPE):
``model_config()`` raises it. TFLOP/s figures name their convention: ``causal_full`` counts causal attention
in full (6N + 12·L·d·s per token, torchtitan and NeMo before Aug 2025), ``causal_half`` at half (6N + 6·L·d·s).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cp_train.model.config import ModelConfig
from cp_train.plan.inputs.presets import model_preset

FLOP_CONVENTIONS = ("causal_full", "causal_half")


@dataclass(frozen=True)
class PublishedRun:
    """One published row: the run's layout and its measured figures (units in the field names)."""

    key: str
    source: str  # URL or repo + path (@ commit)
    row: str  # the table and row in the source
    model: str  # a preset name (cp_train.plan.inputs.presets)
    hardware: str  # a hardware profile name (cp_train.plan.inputs.hardware)
    gpus: int
    seq_len: int  # tokens per sample
    tp: int
    cp: int
    dp: int
    fsdp: bool
    activation_checkpointing: str  # full | selective | none | unknown
    precision: str  # bf16 | fp8 (fp8: the linear layers)
    compiled: bool | None
    global_batch: int | None = None  # samples per optimizer step
    micro_batch: int | None = None  # samples per micro-batch per replica
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu: float | None = None
    flop_convention: str | None = None  # for tflops_per_gpu: causal_full | causal_half
    peak_memory_gib: float | None = None
    attention_fraction_of_ideal: float | None = None  # attention-only runs: measured / ideal (one GPU's kernel)
    cp_algorithm: str | None = None  # ring | allgather | ulysses, when the source says
    cp_layout: str | None = None  # zigzag | stripe | contiguous, when the source says
    notes: str = ""

    @property
    def attention_only(self) -> bool:
        return self.attention_fraction_of_ideal is not None

    @property
    def layout_gpus(self) -> int:
        """tp x cp x dp (equal to ``gpus`` unless ``notes`` explains the source's inconsistency)."""
        return self.tp * self.cp * self.dp

    @property
    def measured(self) -> tuple[float, str]:
        """The headline figure and its unit: tokens_per_s_per_gpu, tflops_per_gpu (convention in
        ``flop_convention``) or attention_fraction_of_ideal."""
        for unit in ("tokens_per_s_per_gpu", "tflops_per_gpu", "attention_fraction_of_ideal"):
            if getattr(self, unit) is not None:
                return getattr(self, unit), unit
        raise ValueError(f"published run {self.key} has no measured figure")

    def model_config(self) -> ModelConfig:
        """The preset, with ``max_position_embeddings`` raised to ``seq_len`` where the run went beyond it."""
        config = model_preset(self.model)
        return replace(config, max_position_embeddings=max(config.max_position_embeddings, self.seq_len))


TITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ b5bcd76c"
TITAN_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @ b5bcd76c"
TITAN_H200 = "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md @ b5bcd76c"
SEQ_8K = "seq_len 8192: train_configs/llama3_{8b,70b}.toml at the benchmark's torchtitan commit (not in the table)"
TITAN_CP = ("CP via PyTorch context_parallel; torchtitan's default rotate method at 9dec370 is allgather "
            "(torchtitan/config_manager.py), the table does not say")
NEMO_LONG = "NVIDIA/NeMo docs/source/performance/performance_long_sequence.md @ 8cfedd72"
NEMO_SUMMARY = "NVIDIA/NeMo docs/source/performance/performance_summary.md @ 8e3d65dc (NeMo 24.07, DGX-H100)"
NEMO_FULL = ("TFLOPS counted in full: NeMo's flops formula discounted causal attention only from Aug 2025 "
             "(NVIDIA/NeMo 6251117f, nemo/utils/flops_formulas.py)")
NEMO_B200_GPUS = "the source's TP x CP x DP is a quarter of its '# of GPUs' in every row of this table"
RING = "zhuzilin/ring-flash-attention README.md @ 899628238f (Performance Summary, batch api, fwd + bwd)"
RING_SHAPE = ("attention only: 8k tokens per GPU (65,536 in all), batch 1, 32 q heads, 8 kv heads, head_dim 128, "
              "causal (benchmark/benchmark_kvpacked_func.py); ideal = one GPU's flash_attn on its 8k, iter/s / 8")


def _titan(key: str, row: str, model: str, seq: int, gpus: int, dp: int, tps: float, mem: float,
           precision: str, compiled: bool, ac: str, local_batch: int, tp: int = 1, cp: int = 1,
           source: str = TITAN, hardware: str = "h100-sxm-96g", notes: str = "") -> PublishedRun:
    return PublishedRun(key, source, row, model, hardware, gpus, seq, tp, cp, dp, True, ac, precision, compiled,
                        global_batch=local_batch * dp, micro_batch=local_batch, tokens_per_s_per_gpu=tps,
                        peak_memory_gib=mem, cp_algorithm="allgather" if cp > 1 else None, notes=notes)


def _nemo(key: str, row: str, model: str, hardware: str, seq_k: int, gpus: int, batch: int, tp: int, dp: int,
          cp: int, tflops: float, notes: str) -> PublishedRun:
    return PublishedRun(key, NEMO_LONG, row, model, hardware, gpus, seq_k * 1024, tp, cp, dp, False, "unknown",
                        "fp8", None, global_batch=batch, tflops_per_gpu=tflops, flop_convention="causal_full",
                        notes=notes)


def _ring(key: str, hardware: str, layout: str, fraction: float, iters: str) -> PublishedRun:
    return PublishedRun(key, RING, f"fwd + bwd (iter/sec), 8x{hardware.split('-')[0].upper()}, {layout}",
                        "llama3-8b", hardware, 8, 65536, 1, 8, 1, False, "none", "bf16", False, global_batch=1,
                        micro_batch=1, attention_fraction_of_ideal=fraction, cp_algorithm="ring",
                        cp_layout=layout, notes=f"{RING_SHAPE}; {iters}")


T1 = "Table 1 (Llama 3.1 8B, 8 GPUs, local batch 2, selective AC)"
T2 = "Table 2 (FSDP + CP + torch.compile + Float8, Llama 3.1 8B, 8 GPUs, local batch 1, full AC)"
T3 = "Table 3 (Llama 3.1 8B, 128 GPUs, local batch 2, selective AC)"
T4 = "Table 4 (Llama 3.1 70B, 256 GPUs, FSDP 32, TP 8, compile + Float8, local batch 16, full AC)"
A70 = "Llama3 70b on 256 H100s, FSDP=32, TP=8, torch.compile, full AC, local batch size 16; Vanilla TP tokens/sec"
A8 = "Llama3 8b on 64 H100s, FSDP=8, TP=8, torch.compile, per op SAC, local batch size 12; Vanilla TP tokens/sec"
PER_GPU = "the column says tokens/sec; per GPU, as Table 4 of llama3_h100_202412_torchtitan.md shows (829, 876)"

PUBLISHED: tuple[PublishedRun, ...] = (
    _titan("titan-8b-8k-fsdp8", f"{T1}: FSDP", "llama3-8b", 8192, 8, 8, 5762, 82.4, "bf16", False, "selective", 2,
           notes=SEQ_8K),
    _titan("titan-8b-8k-fsdp8-compile", f"{T1}: FSDP + torch.compile", "llama3-8b", 8192, 8, 8, 6667, 77.0, "bf16",
           True, "selective", 2, notes=SEQ_8K),
    _titan("titan-8b-8k-fsdp8-fp8", f"{T1}: FSDP + torch.compile + Float8", "llama3-8b", 8192, 8, 8, 8532, 76.8,
           "fp8", True, "selective", 2, notes=SEQ_8K),
    _titan("titan-8b-32k-fsdp8-cp1", f"{T2}: FSDP 8, CP 1", "llama3-8b", 32768, 8, 8, 3890, 83.9, "fp8", True,
           "full", 1),
    _titan("titan-8b-64k-fsdp4-cp2", f"{T2}: FSDP 4, CP 2", "llama3-8b", 65536, 8, 4, 2540, 84.2, "fp8", True,
           "full", 1, cp=2, notes=TITAN_CP),
    _titan("titan-8b-128k-fsdp2-cp4", f"{T2}: FSDP 2, CP 4", "llama3-8b", 131072, 8, 2, 1071, 84.0, "fp8", True,
           "full", 1, cp=4, notes=TITAN_CP),
    _titan("titan-8b-256k-fsdp1-cp8", f"{T2}: FSDP 1, CP 8", "llama3-8b", 262144, 8, 1, 548, 84.5, "fp8", True,
           "full", 1, cp=8, notes=TITAN_CP),
    _titan("titan-8b-8k-fsdp128", f"{T3}: FSDP", "llama3-8b", 8192, 128, 128, 5605, 67.0, "bf16", False,
           "selective", 2, notes=SEQ_8K),
    _titan("titan-8b-8k-fsdp128-compile", f"{T3}: FSDP + torch.compile", "llama3-8b", 8192, 128, 128, 6514, 62.0,
           "bf16", True, "selective", 2, notes=SEQ_8K),
    _titan("titan-8b-8k-fsdp128-fp8", f"{T3}: FSDP + torch.compile + Float8", "llama3-8b", 8192, 128, 128, 8380,
           61.8, "fp8", True, "selective", 2, notes=SEQ_8K),
    _titan("titan-70b-8k-fsdp32-tp8", f"{T4}: 2D", "llama3-70b", 8192, 256, 32, 829, 71.9, "fp8", True, "full", 16,
           tp=8, notes=SEQ_8K),
    _titan("titan-70b-8k-fsdp32-tp8-asynctp", f"{T4}: 2D + AsyncTP", "llama3-70b", 8192, 256, 32, 876, 67.6, "fp8",
           True, "full", 16, tp=8, notes=f"{SEQ_8K}; async TP overlaps TP communication, which the trainer does not"),
    PublishedRun("titan-70b-8k-tp8-bf16", TITAN_ASYNC, f"{A70}: None (bfloat16)", "llama3-70b", "h100-sxm-96g", 256,
                 8192, 8, 1, 32, True, "full", "bf16", True, 512, 16, tokens_per_s_per_gpu=597.3,
                 notes=f"{SEQ_8K}; {PER_GPU}"),
    PublishedRun("titan-70b-8k-tp8-fp8", TITAN_ASYNC, f"{A70}: float8 tensorwise", "llama3-70b", "h100-sxm-96g", 256,
                 8192, 8, 1, 32, True, "full", "fp8", True, 512, 16, tokens_per_s_per_gpu=809.8,
                 notes=f"{SEQ_8K}; {PER_GPU}"),
    PublishedRun("titan-8b-8k-tp8-bf16", TITAN_ASYNC, f"{A8}: None (bfloat16)", "llama3-8b", "h100-sxm-96g", 64,
                 8192, 8, 1, 8, True, "selective", "bf16", True, 96, 12, tokens_per_s_per_gpu=4378,
                 notes=f"{SEQ_8K}; {PER_GPU}"),
    PublishedRun("titan-8b-8k-tp8-fp8", TITAN_ASYNC, f"{A8}: float8 tensorwise", "llama3-8b", "h100-sxm-96g", 64,
                 8192, 8, 1, 8, True, "selective", "fp8", True, 96, 12, tokens_per_s_per_gpu=5078.1,
                 notes=f"{SEQ_8K}; {PER_GPU}"),
    _titan("titan-h200-8b-8k-fsdp32", "Results: NUM_NODES 4", "llama3-8b", 8192, 32, 32, 10938, 47.96, "fp8", True,
           "selective", 2, source=TITAN_H200, hardware="h200",
           notes=f"{SEQ_8K}; float8 with fsdp float8 all-gather; AC from the toml (selective, op)"),
    _titan("titan-h200-8b-8k-fsdp64", "Results: NUM_NODES 8", "llama3-8b", 8192, 64, 64, 10753, 46.97, "fp8", True,
           "selective", 2, source=TITAN_H200, hardware="h200",
           notes=f"{SEQ_8K}; float8 with fsdp float8 all-gather; AC from the toml (selective, op)"),
    _nemo("nemo-l2-7b-4k", "LLAMA2-7B (FP8) - H100: 4K", "llama2-7b", "h100-sxm", 4, 4, 1024, 1, 4, 1, 768, NEMO_FULL),
    _nemo("nemo-l2-7b-16k", "LLAMA2-7B (FP8) - H100: 16K", "llama2-7b", "h100-sxm", 16, 16, 256, 2, 8, 1, 660,
          NEMO_FULL),
    _nemo("nemo-l2-7b-32k", "LLAMA2-7B (FP8) - H100: 32K", "llama2-7b", "h100-sxm", 32, 32, 128, 2, 8, 2, 610,
          NEMO_FULL),
    _nemo("nemo-l2-7b-64k", "LLAMA2-7B (FP8) - H100: 64K", "llama2-7b", "h100-sxm", 64, 64, 64, 4, 8, 2, 574,
          NEMO_FULL),
    _nemo("nemo-l2-7b-128k", "LLAMA2-7B (FP8) - H100: 128K", "llama2-7b", "h100-sxm", 128, 128, 32, 4, 8, 4, 555,
          NEMO_FULL),
    _nemo("nemo-l2-7b-256k", "LLAMA2-7B (FP8) - H100: 256K", "llama2-7b", "h100-sxm", 256, 256, 16, 4, 8, 8, 549,
          NEMO_FULL),
    _nemo("nemo-l2-7b-512k", "LLAMA2-7B (FP8) - H100: 512K", "llama2-7b", "h100-sxm", 512, 512, 8, 8, 4, 16, 549,
          NEMO_FULL),
    _nemo("nemo-l2-7b-1024k", "LLAMA2-7B (FP8) - H100: 1024K", "llama2-7b", "h100-sxm", 1024, 1024, 4, 8, 4, 32, 536,
          NEMO_FULL),
    *(_nemo(f"nemo-l3-8b-b200-{k}k", f"LLAMA3-8B (FP8) - B200: {k}K", "llama3-8b", "b200", k, k, batch, tp, dp, cp,
            tflops, f"{NEMO_FULL}; {NEMO_B200_GPUS}")
      for k, batch, tp, dp, cp, tflops in ((8, 512, 1, 2, 1, 1671), (16, 256, 1, 4, 1, 1717), (32, 128, 1, 4, 2, 1624),
                                           (64, 64, 1, 4, 4, 1600), (128, 32, 2, 4, 4, 1588), (256, 16, 4, 4, 4, 1590),
                                           (512, 8, 4, 4, 8, 1619), (1024, 4, 4, 4, 16, 1608))),
    PublishedRun("nemo-l2-7b-4k-dp8", NEMO_SUMMARY, "Pretraining: LLAMA2-7B, 8 GPUs, GBS 128, MBS 1, 4096, TP1 PP1 CP1",
                 "llama2-7b", "h100-sxm", 8, 4096, 1, 1, 8, False, "unknown", "fp8", None, 128, 1,
                 tokens_per_s_per_gpu=16934, tflops_per_gpu=780, flop_convention="causal_full", notes=NEMO_FULL),
    PublishedRun("nemo-l3-8b-8k-cp2", NEMO_SUMMARY, "Pretraining: LLAMA3-8B, 8 GPUs, GBS 128, MBS 1, 8192, TP1 PP1 CP2",
                 "llama3-8b", "h100-sxm", 8, 8192, 1, 2, 4, False, "unknown", "fp8", None, 128, 1,
                 tokens_per_s_per_gpu=12273, tflops_per_gpu=711, flop_convention="causal_full",
                 notes=f"{NEMO_FULL}; 711e12 / 12273 = 57.9 GFLOP/token = 6N + 12·L·d·s"),
    _ring("ring-h800-zigzag", "h800", "zigzag", 0.902, "17.4 of 19.3 iter/s"),
    _ring("ring-h800-ring", "h800", "contiguous", 0.539, "ring_attn: 10.4 of 19.3 iter/s"),
    _ring("ring-h800-stripe", "h800", "stripe", 0.829, "stripe_attn: 16.0 of 19.3 iter/s"),
    _ring("ring-a100-zigzag", "a100-80g", "zigzag", 0.898, "10.6 of 11.8 iter/s; A100 memory size not stated"),
    _ring("ring-a100-ring", "a100-80g", "contiguous", 0.525, "ring_attn: 6.2 of 11.8 iter/s"),
    _ring("ring-a100-stripe", "a100-80g", "stripe", 0.826, "stripe_attn: 9.75 of 11.8 iter/s"),
)


def published_run(key: str) -> PublishedRun:
    """The row with ``key``; ``KeyError`` listing the keys otherwise."""
    for run in PUBLISHED:
        if run.key == key:
            return run
    raise KeyError(f"no published run {key!r}; the keys are {', '.join(run.key for run in PUBLISHED)}")
