"""`python -m minizero.replay`."""
import sys

from .replay import main

sys.exit(main())
