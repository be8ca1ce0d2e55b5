"""Debian's Chromium driven by Playwright's Python API, as this project's browser test and benchmark use it.

    with sync_playwright() as playwright:
        browser = launch(playwright, profile_dir)
        page = browser.new_page(); page.goto(url)
        wait_until(page, "() => window.worldstream.connected")

The browser is the system package (``/usr/bin/chromium``, ``apt-get install chromium``); Playwright never downloads
one here. The flags keep Chromium's background services from dialling out on a closed network (where they
misbehave), and every launch gets a fresh profile directory.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def launch(playwright: Any, profile_dir: str | Path, **options: Any) -> Any:
    """A persistent context on a fresh ``profile_dir`` (the page's Content-Security-Policy stays enforced)."""
    options.setdefault("viewport", {"width": 1400, "height": 820})
    return playwright.chromium.launch_persistent_context(str(profile_dir), executable_path=str(CHROMIUM),
                                                         headless=True, args=CHROMIUM_ARGS, **options)


def wait_until(page: Any, predicate: str, timeout_s: float = 10.0, poll_s: float = 0.03) -> None:
    """Poll a JavaScript predicate through ``page.evaluate`` (Playwright's own ``wait_for_function`` compiles code
    in the page, which the page's Content-Security-Policy rightly forbids)."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(predicate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true within {timeout_s} s: {predicate}")
        time.sleep(poll_s)


def watched_page(browser: Any, errors: list[str]) -> Any:
    """A new page whose uncaught script errors are appended to ``errors`` (a test asserts there are none)."""
    page = browser.new_page()
    page.on("pageerror", lambda error: errors.append(str(error)))
    return page


def start_playing(page: Any, url: str, image: str | Path, timeout_s: float = 60.0) -> None:
    """Open the play page at ``url``, start a session from ``image`` and return once its first frame is drawn."""
    page.goto(url)
    wait_until(page, "() => window.worldstream.connected && !document.getElementById('start').disabled")
    page.set_input_files("#image", str(image))
    page.click("#start")
    wait_until(page, "() => window.worldstream.painted > 0", timeout_s=timeout_s)
