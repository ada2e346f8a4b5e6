"""parallel/cp."""
