"""Step programs: what every rank issues in one training step, per strategy and layout (data, tensor, pipeline and expert parallelism; owner exchange, split NS, published schedule)."""
