"""parallel/cp/plan."""
