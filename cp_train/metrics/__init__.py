"""cp_train/metrics."""
