"""`python -m minizero.preflight`: under a launcher (torchrun, srun), one rank of the preflight
(ranks.py); given a torchrun line, that line run under a watch (launch.py)."""
import sys

from minizero.preflight import launch

if launch.wraps(sys.argv[1:]):
    sys.exit(launch.main(sys.argv[1:]))

from minizero.preflight.ranks import main  # noqa: E402

sys.exit(main())
