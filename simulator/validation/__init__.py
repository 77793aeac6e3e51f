"""The simulator against published numbers and real runs (read by `harness validate`)."""
