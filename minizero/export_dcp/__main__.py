"""`python -m minizero.export_dcp`."""
import sys

from .command import main

sys.exit(main())
