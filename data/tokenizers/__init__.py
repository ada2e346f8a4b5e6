"""data/tokenizers."""
