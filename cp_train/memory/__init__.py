"""cp_train/memory."""
