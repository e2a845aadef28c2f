"""`python -m minizero.timeline`: the merged view and timeline.png of a traced run (the command lives in minizero/observe/timeline.py)."""
