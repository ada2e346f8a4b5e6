"""parallel/dp."""
