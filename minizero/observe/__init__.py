"""Watching a run without changing it: the per-rank timeline (trace, timeline), DeepSpeed's
comms table (comms_logger), the desync check on collectives, and the per-rank memory table."""
