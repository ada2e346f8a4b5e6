#!/usr/bin/env bash
# Single node: one process per GPU (or per CPU rank), all arguments go to train.py.
#   launch/torchrun.sh launch/configs/gpt-125m-cp8.yaml [--set train.steps=100 ...]
#   NPROC=2 launch/torchrun.sh launch/configs/cpu-tiny.yaml
# NPROC defaults to the number of visible GPUs (2 without GPUs). Extra torchrun options: TORCHRUN_ARGS.
# Runs torchrun through cp_train.launch (same options): a failure ends with one line and the failed
# rank's exit code (2: config or input error, 1: failed run) instead of torchrun's traceback and exit 1.
# Relative paths (the config, --save, --data-path, --run-dir) are the caller's: it runs where it is started.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="${root}${PYTHONPATH:+:${PYTHONPATH}}"
# CUDA's allocator grows segments in place instead of fragmenting (less reserved memory at long sequences);
# a value the caller set wins. Ignored on CPU.
: "${PYTORCH_CUDA_ALLOC_CONF:=expandable_segments:True}"; export PYTORCH_CUDA_ALLOC_CONF
config="${1:?usage: launch/torchrun.sh CONFIG.yaml [train.py flags]}"
shift
if [[ -z "${NPROC:-}" ]]; then
  NPROC=$(python -c "import torch; print(torch.cuda.device_count() or 2)")
fi
exec python -m cp_train.cli.launch --standalone --nproc-per-node "${NPROC}" ${TORCHRUN_ARGS:-} \
  "${root}/train.py" --config "${config}" "$@"
