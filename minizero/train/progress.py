"""The run's progress as a user sees it: tqdm's bar on rank 0, the run's clock, and the
seconds and steps of each logged interval that samples/s is computed from."""
from __future__ import annotations

import logging
import time

from minizero import comm
from minizero.train.runsetup import Run


class Progress:
    """What the loop shows and times: tqdm's bar (rank 0), the run's clock (carried across a
    resume) and the seconds and steps of the current logged interval (for samples/s).

    Inside `with Progress(run)`, records of minizero's and DeepSpeed's loggers go through the
    bar so they don't tear it; on the way out the clock is kept in run.state."""

    def __init__(self, run: Run):
        from tqdm import tqdm
        self.state = run.state
        self.start = time.perf_counter() - run.state["elapsed_s"]
        self.interval_s, self.interval_steps = 0.0, 0
        self.bar = tqdm(total=run.max_steps, initial=run.state["step"], disable=comm.get_rank() != 0,
                        dynamic_ncols=True, desc=run.lib.name)

    def __enter__(self) -> Progress:
        from tqdm.contrib.logging import logging_redirect_tqdm
        self.redirect = logging_redirect_tqdm(loggers=[logging.getLogger("minizero"), logging.getLogger("DeepSpeed")])
        self.redirect.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.redirect.__exit__(*exc)
        finally:
            self.state["elapsed_s"] = self.elapsed_s()
            self.bar.close()

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def step_begins(self) -> None:
        self.t0 = time.perf_counter()

    def step_ends(self) -> None:
        self.interval_s += time.perf_counter() - self.t0
        self.interval_steps += 1

    def new_interval(self) -> None:
        self.interval_s, self.interval_steps = 0.0, 0

    def say(self, line: str) -> None:
        """Rank 0 prints a line above the bar."""
        if comm.get_rank() == 0:
            self.bar.write(line)
