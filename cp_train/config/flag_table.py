"""The flags of ``train.py``'s command line, each a shortcut for one config key (``flags.py`` builds the parser).

``FLAGS`` take a value (Megatron-LM's long names are aliases), ``SWITCHES`` set a value, ``BOOLEAN_FLAGS`` have a
``--no-`` form, ``MANY_WORDS`` take several words.
"""

from __future__ import annotations

import argparse

from cp_train.config.arg_types import JoinedWords, ListWords, megatron_split

# flag -> (dotted key, type, help); Megatron's long names are accepted as aliases
FLAGS: dict[str, tuple[str, type, str, tuple[str, ...]]] = {
    "--tp-size": ("parallel.tp", int, "tensor-parallel size", ("--tensor-model-parallel-size",)),
    "--cp-size": ("parallel.cp", int, "context-parallel size", ("--context-parallel-size",)),
    "--dp-size": ("parallel.dp", int, "data-parallel size (default: world / (tp*cp))", ()),
    "--cp-layout": ("parallel.cp_layout", str, "contiguous, zigzag, stripe or balanced", ()),
    "--cp-algorithm": ("parallel.cp_algorithm", str, "ring, allgather, ulysses or hybrid (or p2p, all_gather, a2a, "
                       "a2a+p2p)", ("--cp-comm-type",)),
    "--ulysses-size": ("parallel.ulysses_size", int, "hybrid: CP ranks per Ulysses group",
                       ("--hierarchical-context-parallel-size",)),
    "--seq-len": ("data.seq_len", int, "tokens per sample", ("--seq-length",)),
    "--micro-batch-size": ("train.micro_batch_size", int, "samples per micro-batch per DP rank", ()),
    "--global-batch-size": ("train.global_batch_size", int, "samples per optimizer step", ()),
    "--lr": ("optimizer.lr", float, "peak learning rate", ()),
    "--min-lr": ("optimizer.min_lr", float, "final learning rate of the decay", ()),
    "--train-steps": ("train.steps", int, "optimizer steps", ("--train-iters",)),
    "--exit-interval": ("train.exit_interval", int, "save and stop after each step that is a multiple of it", ()),
    "--check-replicas-every": ("train.check_replicas_every", int, "every N-th step: compare the weights' replicas "
                               "(0: off)", ("--check-weight-hash-across-dp-replicas-interval",)),
    "--exit-duration-in-mins": ("train.exit_duration_minutes", float, "save and stop after the first step past it", ()),
    "--eval-interval": ("train.valid_interval", int, "steps between validation losses (0: off)", ()),
    "--seed": ("train.seed", int, "runtime RNG seed", ()),
    "--data-path": ("data.prefix", str, "Megatron .bin/.idx prefix, or a blend W1 PREFIX1 W2 PREFIX2 ... or PREFIX1 "
                    "PREFIX2 ... (weighed by tokens) (default: the embedded corpus)", ("--train-data-path",)),
    "--valid-data-path": ("data.valid_prefix", str, "validation data of its own, read whole: a prefix or a blend "
                          "(default: the last data.valid_fraction of --data-path)", ()),
    "--tokenizer-model": ("data.tokenizer", str, "SentencePiece .model, or a HF tokenizer.json or its directory", ()),
    "--save": ("checkpoint.save", str, "checkpoint directory", ()),
    "--load": ("checkpoint.load", str, "checkpoint to resume from", ()),
    "--init-from-hf": ("checkpoint.init_from_hf", str, "Hugging Face Llama directory to start from", ()),
    "--init-from": ("checkpoint.init_from", str, "a cp-train checkpoint whose model weights start a new run (step 0, "
                    "a fresh optimizer and data stream)", ()),
    "--save-interval": ("checkpoint.interval", int, "steps between checkpoints (0: off)", ()),
    "--log-interval": ("logging.interval", int, "steps between metric records", ()),
    "--profile-step-start": ("logging.profile_step_start", int, "--profile: the first step recorded", ()),
    "--profile-step-end": ("logging.profile_step_end", int, "--profile: the step after the last recorded", ()),
    "--profile-ranks": ("logging.profile_ranks", str, "--profile: the ranks that record (default 0)", ()),
    "--run-dir": ("logging.dir", str, "run directory (JSONL, wandb, config)", ()),
    "--wandb-project": ("logging.wandb_project", str, "wandb project", ()),
    "--wandb-mode": ("logging.wandb_mode", str, "online, offline or disabled (default: online only with "
                     "WANDB_API_KEY)", ()),
    # Megatron-LM's names for the model, the schedule and the optimizer
    "--adam-beta1": ("optimizer.beta1", float, "AdamW's beta1", ()),
    "--adam-beta2": ("optimizer.beta2", float, "AdamW's beta2", ()),
    "--adam-eps": ("optimizer.eps", float, "AdamW's epsilon", ()),
    "--init-method-std": ("model.init_std", float, "the weights' initial standard deviation", ()),
    "--rope-theta": ("model.rope_theta", float, "RoPE's base", ("--rotary-base",)),
    "--split": ("data.valid_fraction", megatron_split, "Megatron-LM's train,valid,test weights of the documents: "
                "the valid and test ones (the last) are held out", ()),
    "--norm-epsilon": ("model.norm_eps", float, "RMSNorm's epsilon", ()),
    "--vocab-size": ("model.vocab_size", int, "token ids (default: the tokenizer's, padded to 128)", ()),
    "--kv-channels": ("model.head_dim", int, "the attention heads' width (default: hidden / heads)", ()),
    "--num-workers": ("data.num_workers", int, "loader worker processes", ()),
    "--data-cache-path": ("data.cache_dir", str, "the sample-index cache (default: next to the data)", ()),
    "--distributed-timeout-minutes": ("parallel.timeout_minutes", float, "the bound on every collective", ()),
    "--wandb-exp-name": ("logging.run_name", str, "the run name's prefix (tp/cp/dp and seq_len appended)", ()),
    "--num-layers": ("model.num_layers", int, "transformer blocks", ()),
    "--hidden-size": ("model.hidden_size", int, "model width", ()),
    "--num-attention-heads": ("model.num_heads", int, "attention heads", ()),
    "--num-query-groups": ("model.num_kv_heads", int, "key/value heads (GQA)", ()),
    "--ffn-hidden-size": ("model.ffn_hidden_size", int, "MLP width", ()),
    "--max-position-embeddings": ("model.max_position_embeddings", int, "longest sequence the model takes", ()),
    "--recompute-granularity": ("model.activation_checkpointing", str, "full or selective recomputation", ()),
    "--lr-warmup-iters": ("schedule.warmup_steps", int, "linear warmup steps", ("--warmup-steps",)),
    "--lr-decay-style": ("schedule.decay", str.lower, "cosine, linear, wsd or constant", ()),
    "--weight-decay": ("optimizer.weight_decay", float, "AdamW weight decay", ()),
    "--clip-grad": ("optimizer.clip_grad", float, "global gradient-norm clip (0: off)", ()),
    "--eval-iters": ("train.valid_iters", int, "validation batches per validation", ()),
    "--gradient-accumulation-steps": ("train.gradient_accumulation_steps", int, "micro-batches per step and DP "
                                      "rank (sets the global batch)", ()),
}
# switches: flag -> (dotted key, value set, help)
SWITCHES: dict[str, tuple[str, object, str]] = {
    "--bf16": ("train.dtype", "bf16", "bf16 autocast"),
    "--recompute-activations": ("model.activation_checkpointing", "selective", "selective recomputation"),
    "--use-flash-attn": ("model.attention_kernel", "flash_attn", "flash-attn kernels (CUDA)"),
    "--sequence-parallel": ("parallel.sequence_parallel", True, "shard the residual stream over TP"),
    "--restart-schedule": ("schedule.restart", True, "on a resume that changed train.steps, restart the LR "
                           "schedule instead of continuing it"),
    "--qk-layernorm": ("model.qk_norm", True, "an RMSNorm over each head's queries and keys"),
    "--add-qkv-bias": ("model.qkv_bias", True, "biases on the q, k and v projections"),
    "--untie-embeddings-and-output-weights": ("model.tie_embeddings", False, "the LM head a weight of its own"),
    "--reset-position-ids": ("data.reset_position_ids", True, "positions restart in every packed document"),
    "--reset-attention-mask": ("data.document_mask", True, "attention inside each packed document"),
    "--eod-mask-loss": ("data.mask_eod_loss", True, "no loss on the end-of-document tokens"),
    "--log-params-norm": ("logging.params_norm", True, "the parameters' L2 norm in each record (one more read of "
                          "the device per log step)"),
    "--profile": ("logging.profile", True, "torch.profiler traces of steps --profile-step-start .. "
                  "--profile-step-end - 1 in <run dir>/profile, and their idle fraction"),
    "--use-pytorch-profiler": ("logging.profile", True, "Megatron-LM's name of --profile"),
    "--record-memory-history": ("logging.memory_snapshot", True, "with --profile on CUDA: the caching allocator's "
                                "history over the profiled steps"),
}

# the flags that take several words; Megatron-LM's blend: --data-path 0.7 data/web 0.3 data/code
MANY_WORDS: dict[str, type[argparse.Action]] = {"--data-path": JoinedWords, "--valid-data-path": JoinedWords,
                                                "--profile-ranks": ListWords}


BOOLEAN_FLAGS = {"--fsdp": "parallel.fsdp", "--compile": "train.compile",  # with --no-... forms
                 "--async-save": "checkpoint.async_save"}  # Megatron-LM's name
BOOLEAN_FLAGS_SPEC = {flag: (key,) for flag, key in BOOLEAN_FLAGS.items()}
