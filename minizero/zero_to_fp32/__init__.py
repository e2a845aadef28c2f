"""`python -m minizero.zero_to_fp32`: one fp32 state dict from a sharded checkpoint (the command lives in minizero/checkpoint_files/zero_to_fp32.py)."""
