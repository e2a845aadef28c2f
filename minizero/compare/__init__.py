"""`python -m minizero.compare`: minizero and DeepSpeed run side by side, and the report of their
losses, memory (compare_memory) and communication (compare_comms)."""
