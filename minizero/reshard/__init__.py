"""`python -m minizero.reshard`: a checkpoint rewritten for another world size or stage (the command lives in minizero/checkpoint_files/reshard.py)."""
