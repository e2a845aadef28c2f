import os
import sys

# The tests import `tests.launcher`; make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
