"""`python -m minizero.train`. The command line is checked before torch is imported
(train_args.precheck): a usage error or --help answers at once, not after ~3 s of imports."""
from .train_args import build_parser, precheck

precheck(build_parser())

from .train import main  # noqa: E402

main()
