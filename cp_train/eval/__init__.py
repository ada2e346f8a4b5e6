"""Long-context evaluation through the CP forward pass (``cp-train-eval``, ``python -m cp_train.eval``).

Teacher-forced tasks, no generation: ``loss_by_position`` (NLL in log2 buckets of the position within the
document), ``passkey`` (Landmark's format) and ``niah`` (gkamradt's needle in a haystack of the run's data).
Modules, one concern each: ``prompts`` (the token sequences), ``scoring`` (what a CP forward scores, reduced
over the groups), ``tasks`` (the grids and their records), ``report`` (JSON lines, the table, PNGs, wandb),
``load`` (the model from a DCP checkpoint or an HF directory), ``cli`` (the command), ``periodic`` (``eval.every``
inside training). See docs/eval.md.
"""
