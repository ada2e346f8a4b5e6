#!/usr/bin/env bash
# The GPU checks of issues 45, 48 and 49 on one lent H100/H200, in the order a short lease is spent:
#
#   bash bench/gpu_acceptance.sh                      # setup tests graphs profile offload fp8 swiglu
#   bash bench/gpu_acceptance.sh setup fp8            # some parts only
#
# Each part runs under its own time limit (seconds, below) and writes its whole log to $OUT/<part>.log
# (default runs/gpu-acceptance); the console gets each part's key lines. torchao comes from .whl/ when
# that folder holds its wheel (the lent machines have no registry), and setuptools, the editable install's build
# backend, from there too when it holds one; the project installs in place.
#   tests    python -m pytest tests/gpu
#   graphs   bench.cudnn_graphs: cp 4 zigzag thread ranks, 16,384 tokens of packed documents, 12 steps,
#            without and with the ring's warm-up (new cuDNN graph keys per step)
#   profile  the 1B config at cp 1, 2 x 16,384 tokens of packed documents, compiled, 20 steps logged every 5:
#            MFU, the scheduled profile's idle fraction, new cuDNN keys per step (bench.step_profile)
#   profile-nofsdp  the same without FSDP
#   ragged   (not run by default; issue 45's MFU lever) the cudnn_ragged backend: bench.document_attention (the 1B
#            attention at 16k on the corpus's documents: cudnn's flash varlen against cudnn_ragged's dense calls),
#            tests.gpu.ragged_check (its trial, the ring with documents against float64), bench.cudnn_graphs on it,
#            and the profile above on it with ZeRO-2 (parallel.fsdp_reshard_after_forward false); about 7 minutes
#   offload  bench.offload at 128k tokens (the longest power of two the 1B config fits without offload on an H200:
#            84.4 GiB; 2026-11-30) and 256k, with and without activation offload; 256k with offload needs ~115 GiB
#            of pinned host memory and is reported as not run on a 128 GiB host
#   fp8      bench.fp8: bf16, tensorwise, rowwise, 100 compiled steps of 16,384 tokens each, each in its own process
#            (its table gives each run's peak GiB beside the dry run's plan: 40.3, 31.1, 31.1 GiB since 2026-12-02;
#            every run's last lines also print peak allocated / planned)
#
# Measured on an H200 (2026-11-30): setup 25 s (with the machine's start, about 90 s), tests 206 s, graphs 12 s,
# profile 82 s, offload at 64k 159 s (its four cases done, stopped at its limit on the way out), fp8 about 80 s a
# variant. The next lease (2026-12-02): `setup tests` (~230 s), then `setup ragged fp8-gemms` (~480 s); issue 49's
# `setup fp8` (~300 s) and the other fp8 parts need another.
#   fp8-profile (not run by default; about 90 s) the step profile of fp8's tensorwise run (no FSDP, one sample of
#            16,384 tokens): kernel time by kind, and fp8_s: the FP8 GEMMs' time and the scales' amax reductions
#   fp8-8b   (not run by default) bench.fp8 at Llama-3.1-8B's layer shape (hidden 4096, 32 heads, 8 kv heads, ffn
#            14336), 8 layers, 8,192 tokens, 40 steps: where the linears are most of the step, as in torchtitan's
#            8k table (at 1B and 16k they are 39% of it and tensorwise gave 1.02x on an H200, 2026-11-30)
#   fp8-fsdp (not run by default) bench.fp8 --fsdp: tensorwise under FSDP2, its weights gathered in FP8, 30 steps
#   fp8-gemms (not run by default; about 30 s) bench.fp8_linears --parts gemm: the 1B block's four linears at
#            16,384 tokens, their three GEMMs each in bf16 and in FP8 as torchao's tensorwise and rowwise run them,
#            and tensorwise with every GEMM accumulating fast (model.fp8_fast_accum=all: torchao's recipes
#            accumulate the backward's two slowly), and the best FP8 step the linears allow (bf16's step from
#            fp8's run when it ran first, else 0.373 s), with tensorwise's casts counted (1.12x planned at 1B/16k)
#   fp8-linears (not run by default; about 3 minutes) the same with each linear's compiled forward and backward
#            (its casts included), bf16, tensorwise and tensorwise-fast
#   fp8-fast (not run by default; about 80 s) bench.fp8's tensorwise-fast, 100 steps, against bf16's record from
#            fp8's run (run fp8 first): speed and the loss at step 100 with the backward accumulating fast
#   swiglu   bench.swiglu at the 1B MLP's shape in bf16: gate and up as two weights against the fused weight's one
#            matmul (eager node, compiled gated_silu)
set -u
OUT=${OUT:-runs/gpu-acceptance}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CP_TRAIN_CACHE=/tmp/cp-train-cache
if [ -d /tmp/site ]; then  # torchao, installed there by an earlier setup: parts run without setup find it too
    export PYTHONPATH=/tmp/site
fi
PARTS=${*:-setup tests graphs profile offload fp8 swiglu}

run_part() {  # name limit command...: the command's log in $OUT/name.log, its exit code and seconds on the console
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "=== $name (limit ${limit} s) $(date +%T)"
    timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name: exit $? in $((SECONDS - start)) s"
}

for part in $PARTS; do
    case $part in
    setup)
        nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv,noheader
        if ls .whl/torchao-*.whl > /dev/null 2>&1; then
            python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/torchao-*.whl
        fi
        if ls .whl/setuptools-*.whl > /dev/null 2>&1; then  # the build backend, for a python3 without setuptools
            python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/build-site .whl/setuptools-*.whl
        fi
        PYTHONPATH=/tmp/build-site python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
        export PYTHONPATH=/tmp/site
        python3 -c "import cp_train.model" || echo "SETUP FAILED: cp_train.model does not import (see above)"
        python3 -c "import torch, cp_train; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())"
        python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
        ;;
    tests)
        run_part tests 300 python3 -m pytest -q -p no:cacheprovider -rfE --durations=12 tests/gpu
        grep -E "passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | tail -12
        grep -E "^[0-9.]+s (call|setup)" "$OUT/tests.log" | head -12  # where the part's 200 s go, for the next plan
        ;;
    graphs)
        run_part graphs 90 bash -c "python3 -m bench.cudnn_graphs --steps 12 --no-warm && python3 -m bench.cudnn_graphs --steps 12"
        grep -E '"step": (1|2|3|4|12),|summary' "$OUT/graphs.log"
        ;;
    profile)
        run_part profile 180 torchrun --nproc-per-node 1 -m bench.step_profile \
            --config launch/configs/gpt-1b-128k-cp8.yaml --cp-size 1 --set data.seq_len=16384 \
            --set train.global_batch_size=2 --train-steps 20 --set schedule.warmup_steps=2 \
            --set logging.interval=5 --set logging.wandb=false --set checkpoint.save=null --set checkpoint.interval=0 \
            --set train.valid_interval=0 --set logging.dir=/tmp/profile-run --skip 6 --active 3
        cp /tmp/profile-run/metrics.jsonl "$OUT/profile_metrics.jsonl" 2> /dev/null
        cp /tmp/profile-run/profile/*.json.gz "$OUT/" 2> /dev/null  # the recorded steps' Chrome trace
        grep -E '^PROFILE \{|^PROFILE .*ms/step' "$OUT/profile.log" | head -12
        grep -iE 'mfu|step [0-9]+ |planner|measured' "$OUT/profile.log" | tail -8
        ;;
    ragged)  # cudnn_ragged: its trial, the ring with documents against float64, its graphs, the 1B profile on it
        run_part document-attention 150 python3 -m bench.document_attention  # cudnn (flash varlen) vs cudnn_ragged
        tail -6 "$OUT/document-attention.log"
        run_part ragged-check 120 python3 -m tests.gpu.ragged_check
        tail -1 "$OUT/ragged-check.log" | cut -c1-600
        run_part graphs-ragged 90 python3 -m bench.cudnn_graphs --steps 12 --kernel cudnn_ragged
        grep -E '"step": (1|2|3|4|12),|summary' "$OUT/graphs-ragged.log"
        # ZeRO-2: on one rank FSDP shards nothing, and ZeRO-3 cast every block's weights again for the backward
        # (FSDP::pre_backward's copies, 7.8 of the 30 ms a step FSDP's kernels took in the 2026-11-30 trace)
        run_part profile-ragged 180 torchrun --nproc-per-node 1 -m bench.step_profile \
            --config launch/configs/gpt-1b-128k-cp8.yaml --cp-size 1 --set data.seq_len=16384 \
            --set train.global_batch_size=2 --train-steps 20 --set schedule.warmup_steps=2 \
            --set logging.interval=5 --set logging.wandb=false --set checkpoint.save=null --set checkpoint.interval=0 \
            --set train.valid_interval=0 --set logging.dir=/tmp/profile-ragged \
            --set model.attention_kernel=cudnn_ragged --set parallel.fsdp_reshard_after_forward=false \
            --skip 6 --active 3
        cp /tmp/profile-ragged/profile/*.json.gz "$OUT/ragged-trace.json.gz" 2> /dev/null
        grep -E '^PROFILE \{|^PROFILE .*ms/step' "$OUT/profile-ragged.log" | head -12
        grep -iE 'mfu|step [0-9]+ |planner|measured|cudnn_ragged' "$OUT/profile-ragged.log" | tail -8
        ;;
    profile-nofsdp)  # the same run without FSDP (one rank: FSDP's gathers and reduce-scatters are copies)
        run_part profile-nofsdp 180 torchrun --nproc-per-node 1 -m bench.step_profile \
            --config launch/configs/gpt-1b-128k-cp8.yaml --cp-size 1 --set data.seq_len=16384 \
            --set train.global_batch_size=2 --train-steps 20 --set schedule.warmup_steps=2 \
            --set logging.interval=5 --set logging.wandb=false --set checkpoint.save=null --set checkpoint.interval=0 \
            --set train.valid_interval=0 --set logging.dir=/tmp/profile-nofsdp --set parallel.fsdp=false --skip 6 --active 3
        grep -E '^PROFILE \{' "$OUT/profile-nofsdp.log" | head -3
        grep -iE 'mfu' "$OUT/profile-nofsdp.log" | tail -4
        ;;
    offload)
        run_part offload 170 python3 -m bench.offload --seq 131072 --warmup 1 --repeats 1
        grep "^DONE" "$OUT/offload.log" | cut -c1-300  # each case as it finished (all four: the table below)
        tail -8 "$OUT/offload.log"
        ;;
    fp8)
        run_part fp8 330 python3 -m bench.fp8 --steps 100 --out /tmp/fp8-runs
        grep "^DONE" "$OUT/fp8.log" | cut -c1-400  # each variant as it finished (all three: the table below)
        tail -6 "$OUT/fp8.log"
        ;;
    fp8-gemms|fp8-linears)
        step=$(python3 -c "import json; print(json.load(open('/tmp/fp8-runs/none.record.json'))['step_time_s'])" \
            2> /dev/null || echo 0.373)  # bf16's measured step (2026-11-30: 0.373 s)
        parts=$([ "$part" = fp8-gemms ] && echo "gemm" || echo "gemm linear --recipes bf16 tensorwise tensorwise-fast")
        run_part "$part" 240 python3 -m bench.fp8_linears --parts $parts --bf16-step "$step"
        grep -v "^{" "$OUT/$part.log" | tail -24  # the table
        ;;
    fp8-fast)
        run_part fp8-fast 150 python3 -m bench.fp8 --steps 100 --out /tmp/fp8-runs --variants tensorwise-fast \
            --baseline /tmp/fp8-runs/none.record.json
        tail -4 "$OUT/fp8-fast.log"
        ;;
    fp8-profile)  # where the FP8 step's time goes: bench.fp8's tensorwise run (no FSDP, one sample), profiled
        run_part fp8-profile 180 torchrun --nproc-per-node 1 -m bench.step_profile \
            --config launch/configs/gpt-1b-128k-cp8.yaml --cp-size 1 --set data.seq_len=16384 \
            --set train.global_batch_size=1 --train-steps 14 --set schedule.warmup_steps=2 --set parallel.fsdp=false \
            --set model.fp8=tensorwise --set logging.interval=5 --set logging.wandb=false --set checkpoint.save=null \
            --set checkpoint.interval=0 --set train.valid_interval=0 --set logging.dir=/tmp/fp8-profile --skip 6 --active 3
        cp /tmp/fp8-profile/profile/*.json.gz "$OUT/fp8-trace.json.gz" 2> /dev/null
        grep -E '^PROFILE \{|^PROFILE .*ms/step' "$OUT/fp8-profile.log" | head -14
        grep -iE 'mfu' "$OUT/fp8-profile.log" | tail -3
        ;;
    fp8-8b)
        run_part fp8-8b 300 python3 -m bench.fp8 --steps 40 --seq 8192 --out /tmp/fp8-8b-runs \
            --set model.hidden_size=4096 --set model.num_heads=32 --set model.num_kv_heads=8 \
            --set model.ffn_hidden_size=14336 --set model.num_layers=8
        grep "^DONE" "$OUT/fp8-8b.log" | cut -c1-400
        tail -6 "$OUT/fp8-8b.log"
        ;;
    fp8-fsdp)
        run_part fp8-fsdp 150 python3 -m bench.fp8 --fsdp --variants tensorwise --steps 30 --out /tmp/fp8-fsdp-runs
        tail -4 "$OUT/fp8-fsdp.log"
        ;;
    swiglu)
        run_part swiglu 120 python3 -m bench.swiglu --device cuda --dtype bf16 --tokens 16384 --hidden 2048 \
            --ffn 8192 --rounds 20 --warmup 3
        tail -10 "$OUT/swiglu.log"
        ;;
    *) echo "unknown part $part" ;;
    esac
done
