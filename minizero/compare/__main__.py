"""`python -m minizero.compare`."""
from .compare import main

main()
