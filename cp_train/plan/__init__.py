"""``python -m cp_train.plan``: an alias of ``cp-train-plan`` (the planner lives in ``cp_train.perf``)."""
