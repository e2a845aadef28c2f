"""`python -m minizero.train`: the training application around the engine (the loop, its flags,
setup and resume, metrics and samples, the non-finite guard, the run folder's lock)."""
