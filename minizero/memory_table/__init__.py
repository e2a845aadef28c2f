"""`python -m minizero.memory_table`: each rank's model-state bytes at any world size (the command lives in minizero/observe/memory_table.py)."""
