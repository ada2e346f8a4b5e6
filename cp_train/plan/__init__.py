"""The planner (``cp-train-plan``): step time, MFU and memory per layout, predicted before renting a cluster.

Data: ``hardware`` (GPU constants, built-in profiles in ``profiles/*.yaml``), ``presets`` (model shapes),
``published`` (measured runs the predictions are checked against); see docs/planner.md.
"""
