"""`python -m minizero.export_deepspeed`."""
import sys

from ..checkpoint.export_deepspeed import main

sys.exit(main())
