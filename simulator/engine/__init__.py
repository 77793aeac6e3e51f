"""The event loop: per-rank streams and collectives as rendezvous (SimPy, heap-based and compiled in C: the same model, bit for bit), and reading a finished run (metrics, traces)."""
