"""cp-train: parallel package."""
