"""cp_train/cli."""
