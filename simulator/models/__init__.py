"""What is trained: workloads (catalog, files, Hugging Face config.json), their matrices, compute per layer, memory of a layout, and the benchmark model of `harness bench step`."""
