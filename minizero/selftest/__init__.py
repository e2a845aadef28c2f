"""`python -m minizero.selftest`: the one-minute check of an install (the command lives in minizero/runtime/selftest.py)."""
