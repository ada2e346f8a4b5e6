"""cp_train/config."""
