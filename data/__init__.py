"""cp-train: data package."""
