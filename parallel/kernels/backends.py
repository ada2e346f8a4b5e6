"""The attention kernels' names (``model.attention_kernel``), in ``select.py``'s order of preference: what the config
reads, without torch."""

BACKENDS: tuple[str, ...] = ("fa3", "cudnn", "flash_attn", "torch", "torch_efficient", "math")
