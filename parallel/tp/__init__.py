"""parallel/tp."""
