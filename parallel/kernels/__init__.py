"""parallel/kernels."""
