"""`python -m minizero.export_deepspeed`: a minizero checkpoint written as DeepSpeed's folder (the command lives in minizero/checkpoint_files/export_deepspeed.py)."""
