"""`python -m minizero.selftest`."""
import sys

from ..runtime.selftest import main

sys.exit(main())
