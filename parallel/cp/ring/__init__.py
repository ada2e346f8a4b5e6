"""parallel/cp/ring."""
