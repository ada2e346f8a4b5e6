"""cp-train: cp_train package."""
