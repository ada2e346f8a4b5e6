"""The attention kernels' names (``model.attention_kernel``), in ``select.py``'s order of preference (``cudnn_ragged``
by name only): what the config reads, without torch."""

BACKENDS: tuple[str, ...] = ("fa3", "cudnn", "cudnn_ragged", "flash_attn", "torch", "torch_efficient", "math")
