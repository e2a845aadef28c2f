"""`python -m minizero.reshard`."""
import sys

from ..checkpoint_files.reshard import main

sys.exit(main())
