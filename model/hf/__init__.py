"""model/hf."""
