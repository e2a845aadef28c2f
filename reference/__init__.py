"""DeepSpeed reference runs and memory probes for the minizero agreement tests."""
