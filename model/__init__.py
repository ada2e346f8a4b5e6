"""cp-train: model package."""
