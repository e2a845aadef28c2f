"""The system's Chromium, headless and offline, through Playwright: the browser the replay
page's and the slide deck's tests open their pages in (Playwright's own browsers cannot be
downloaded here, so it drives the system's). Either missing: the test skips with the line
that installs it."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import pytest

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
INSTALL = ("needs Playwright for Python and the system's Chromium: pip install playwright; "
           "apt-get install chromium (or set MINIZERO_CHROMIUM to a Chromium binary)")


def chromium_path() -> str | None:
    return os.environ.get("MINIZERO_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@contextlib.contextmanager
def offline_chromium(profile_prefix: str):
    """One headless Chromium (a fresh profile), offline, at 1280 x 720: yields (context,
    requests), `requests` every URL any of its pages asked for; anything but a file: URL is
    aborted."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(INSTALL)
    exe = chromium_path()
    if exe is None:
        pytest.skip(INSTALL)
    profile = tempfile.mkdtemp(prefix=profile_prefix)
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(profile, executable_path=exe, args=CHROMIUM_ARGS,
                                                       headless=True, viewport={"width": 1280, "height": 720})
        context.set_offline(True)
        requests = []
        context.on("request", lambda req: requests.append(req.url))
        context.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                      else route.abort())
        try:
            yield context, requests
        finally:
            context.close()
            shutil.rmtree(profile, ignore_errors=True)
