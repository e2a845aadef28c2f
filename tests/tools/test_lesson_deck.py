"""The class's slide deck (docs/lesson/slides/deck.html) in a real browser, offline.

docs/lesson/deck.py turns docs/lesson/src/deck.md.in, filled in by lesson_numbers.py, into one
HTML file (test_lesson_numbers.py holds it to its source). Here headless Chromium opens it
from disk with the network off, as a laptop on a projector would, and checks what the room
sees: nothing requested but the file itself (its content policy blocks anything else, and
nothing tried), no script error; the title and objectives slides; both sessions' plans; a slide
for each of parts 1-7; the ten pictures, each loaded; the code each part projects, every line
on the slide at a readable size; the formulas; links to the replay pages the class's runs
write (parts 2, 3 and 11); the keys (right and left, N for the notes) doing what the page says.

Cost: one Chromium (about a second to start) and some 30 slides shown once; skipped, with the
line to install them, where Playwright or Chromium is missing (tests/support/browser.py).
"""
from __future__ import annotations

import os
import re

import pytest

from tests.support.browser import offline_chromium

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DECK = os.path.join(ROOT, "docs", "lesson", "slides", "deck.html")


@pytest.fixture(scope="module")
def deck():
    with offline_chromium("deck-chromium-") as (context, requests):
        page = context.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.goto("file://" + DECK)
        yield page, requests, errors


def _slide(page) -> dict:
    return page.evaluate("""() => {
        const s = document.querySelector('.slide.current'), b = s.querySelector('.body');
        return {title: (s.querySelector('h1') || {}).textContent || '', part: s.dataset.part || null,
                overflows: b.scrollHeight > b.clientHeight + 2,
                code: Array.from(s.querySelectorAll('pre.code')).map(p => ({
                    px: parseFloat(getComputedStyle(p).fontSize), cut: p.scrollHeight > p.clientHeight + 1,
                    lines: p.querySelectorAll('span').length, text: p.textContent})),
                pictures: Array.from(s.querySelectorAll('img')).map(i => [i.dataset.name, i.naturalWidth,
                                                                          i.src.startsWith('data:image/png')]),
                formulas: s.querySelectorAll('.formula').length,
                links: Array.from(s.querySelectorAll('a')).map(a => a.getAttribute('href')),
                text: s.querySelector('.body').innerText};
    }""")


def test_the_deck_opens_offline_and_shows_every_slide_readably(deck):
    page, requests, errors = deck
    assert requests == ["file://" + DECK] and errors == []
    assert page.evaluate("window.deck.blocked") == []
    n = page.evaluate("window.deck.count")
    source = open(os.path.join(ROOT, "docs", "lesson", "src", "deck.md.in")).read()
    assert n == len(re.findall(r"^---$", source, flags=re.M)) + 1 >= 20
    slides = []
    for i in range(n):
        page.evaluate(f"window.deck.show({i})")
        slides.append(_slide(page))
    titles = [s["title"] for s in slides]
    assert titles[0].startswith("ZeRO on a laptop") and titles[1] == "After these two classes you can"
    assert len(re.findall(r"\n", slides[1]["text"])) >= 6                 # the seven objectives
    assert any(t.startswith("Session 1") for t in titles) and any(t.startswith("Session 2") for t in titles)
    assert {s["part"] for s in slides if s["part"]} == {str(k) for k in range(1, 8)}
    pictures = [p for s in slides for p in s["pictures"]]
    assert sorted(int(name[:2]) for name, _, _ in pictures) == list(range(1, 11))   # the ten pictures, once each
    assert all(width > 0 and inline for _, width, inline in pictures)
    code = [c for s in slides for c in s["code"]]
    projected = [c for c in code if "what it adds and overrides" in c["text"] or "class Unit" in c["text"]]
    assert len(projected) >= 5                                           # the three projections and Unit's hooks
    assert all(not c["cut"] and c["px"] >= 11 for c in code), [(c["px"], c["cut"]) for c in code]
    assert not [s["title"] for s in slides if s["overflows"]]
    assert sum(s["formulas"] for s in slides) >= 4
    links = [link for s in slides for link in s["links"]]
    for run in ("trace-z3/replay.html", "trace-overlap-off/replay-vs-trace-overlap-on.html",
                "trace-nodes-zero3/replay-vs-trace-nodes-hpz.html"):
        assert f"../../../runs/{run}" in links, run


def test_the_keys_move_and_show_the_notes(deck):
    page, _, _ = deck
    page.evaluate("window.deck.show(0)")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    assert page.evaluate("window.deck.at()") == 2 and page.url.endswith("#3")
    page.keyboard.press("ArrowLeft")
    assert page.evaluate("window.deck.at()") == 1
    notes = "document.querySelector('.slide.current .notes')"
    assert page.evaluate(f"getComputedStyle({notes}).display") == "none"
    page.evaluate("window.deck.show(0)")
    page.keyboard.press("n")
    assert page.evaluate(f"getComputedStyle({notes}).display") == "block"
    assert "right arrow" in page.evaluate(f"{notes}.innerText")
    page.keyboard.press("n")
