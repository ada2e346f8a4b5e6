"""The planner's inputs: hardware profiles (``profiles/*.yaml``), model presets and published runs."""
