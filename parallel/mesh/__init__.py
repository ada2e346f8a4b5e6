"""parallel/mesh."""
