"""cp_train/checkpoint."""
