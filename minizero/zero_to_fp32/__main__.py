"""`python -m minizero.zero_to_fp32`."""
import sys

from ..checkpoint_files.zero_to_fp32 import main

sys.exit(main())
