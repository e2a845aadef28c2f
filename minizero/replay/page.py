"""The replay page: one HTML file, everything inline (style, script, the traced step's data), so
it opens from a USB stick in a classroom with no network: no CDN, no font, no request.

    write_page([doc], "trace/replay.html")              # one run
    write_page([doc_a, doc_b], "a_vs_b.html", names)    # two runs side by side, on one clock

The page (replay.js) draws what build.run_data computed from each trace; nothing is computed
from a formula except the paper's column, printed beside the measured values at the step's end.
"""
from __future__ import annotations

import html
import json
import os

from .build import run_data

HERE = os.path.dirname(os.path.abspath(__file__))


def _asset(name: str) -> str:
    with open(os.path.join(HERE, name), encoding="utf-8") as f:
        return f.read()


def page_html(runs: list[dict]) -> str:
    """The page's text for the runs' data (build.run_data)."""
    data = json.dumps({"runs": runs}, separators=(",", ":"))
    # inside <script>, "</" would end the element: JSON allows "<\/" for it
    data = data.replace("</", "<\\/")
    title = " | ".join(r["title"] for r in runs)
    return (_asset("replay.html")
            .replace("{{title}}", html.escape(title))
            .replace("/*{{style}}*/", _asset("replay.css"))
            .replace("{{data}}", data)
            .replace("/*{{script}}*/", _asset("replay.js")))


def write_page(docs: list[dict], path: str, names: list[str] | None = None, step: int | None = None) -> str:
    """Write the replay of each merged trace document (timeline.merge, trace.json) to `path`,
    atomically; `names`: what each run is called on the page (default: its folder's name)."""
    if names is None:
        base = os.path.basename(os.path.dirname(os.path.abspath(path))) or "run"
        names = [base] if len(docs) == 1 else [f"run {i + 1}" for i in range(len(docs))]
    runs = [run_data(doc, name, step) for doc, name in zip(docs, names)]
    text = page_html(runs)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return path
