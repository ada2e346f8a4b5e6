"""parallel/cp/ulysses."""
