"""`python -m minizero.replay TRACE_OR_RUN_DIR [OTHER]`: a traced step replayed in a browser, rank by
rank and event by event, memory included: one self-contained HTML file (replay.py has the command,
build.py the data it shows, page.py and replay.html/.css/.js the page; docs/replay.md)."""
