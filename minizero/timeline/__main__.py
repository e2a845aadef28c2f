"""`python -m minizero.timeline`."""
import sys

from ..observe.timeline import main

sys.exit(main())
