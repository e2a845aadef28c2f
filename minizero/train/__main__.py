"""`python -m minizero.train`."""
from .train import main

main()
