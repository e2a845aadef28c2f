"""Watching a run without changing it, through comm.py's observer hook: the per-rank timeline (trace,
timeline), DeepSpeed's comms table, the desync check, the memory table; switches: what a config turns on."""
