"""`python -m minizero.export_deepspeed`."""
import sys

from ..checkpoint_files.export_deepspeed import main

sys.exit(main())
