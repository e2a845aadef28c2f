"""`python -m minizero.reshard`."""
import sys

from ..checkpoint.reshard import main

sys.exit(main())
