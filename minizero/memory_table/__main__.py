"""`python -m minizero.memory_table`."""
import sys

from ..observe.memory_table import main

sys.exit(main())
