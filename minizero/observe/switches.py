"""The tools an engine's config switches on, attached as the engine starts.

The engine imports none of them: `minizero.initialize` calls `subscribe()`, which puts the
desync check (always on: it also names a collective that times out) and `switches` on
comm.py's observer hook. When an engine announces `engine_starts` (it has its config, before
its first collective) the comms logger starts if the config's `comms_logger` section
enables it; at `engine_ready` the timeline trace starts if `minizero_trace` does.
"""
from __future__ import annotations

from .. import comm
from . import comms_logger, desync, trace


class ConfigSwitches:
    """comm.py's observer that reads an engine's config and starts what it asks for."""

    def engine_starts(self, engine) -> None:
        comms_logger.start(engine)

    def engine_ready(self, engine) -> None:
        if engine.config.trace.enabled:
            trace.start(engine, engine.config.trace.output_path, engine.config.trace.steps)


switches = ConfigSwitches()


def subscribe() -> None:
    """Watch every engine of this process from now on (idempotent)."""
    desync.subscribe()
    if switches not in comm.observers:
        comm.subscribe(switches)
