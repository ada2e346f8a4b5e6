"""The planner (``cp-train-plan``, ``cp_train/cli/plan.py``): step time, throughput, MFU and memory of a layout on
GPUs, each with the range measured runs like it came out in, predicted before renting a cluster (docs/planner.md).

Inputs (``inputs/``): GPU profiles, model presets, packed documents, measured runs. The prediction: ``workload``
(what a rank computes and sends) -> ``time_model`` with ``rates`` and ``host`` -> ``predict`` (with the dry run's
memory and ``ranges``' error band); ``search`` ranks layouts, ``explain`` puts one in words, ``run_check`` makes
every training run check it, ``calibrate`` measures a GPU.
"""
