"""`python -m minizero.compare`: minizero and DeepSpeed run side by side (compare), and the report of
their losses, memory (compare_memory), communication (compare_comms) and bytes between pretended
nodes (compare_nodes), written by report and drawn by render."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # minizero/compare/ -> the repository
