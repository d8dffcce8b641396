"""A real headless Chromium for the browser tests, driven by Playwright, and screenshots.

The browser is the system's (Debian's ``chromium``; ``OUTBOUND_TEST_CHROMIUM``
names another binary); Playwright never downloads one. A test module starts
one browser (:func:`browser` as a module fixture) and each test opens a
context of its own, closed at its end so that no connection stays open.

``OUTBOUND_SCREENSHOTS=DIR`` makes the tests save the README's screenshots
there (``OUTBOUND_SCREENSHOTS=docs python -m pytest tests/outbox/test_status_browser.py
tests/contrib/test_django_admin.py``); otherwise they are taken to a temporary file
and only checked.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: The flags the browser runs with: headless, no sandbox (root in CI), and
#: nothing that reaches out to the network on its own.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]

#: Every wait for the page, in milliseconds.
TIMEOUT_MS = 15_000


def chromium_path() -> str | None:
    named = os.environ.get("OUTBOUND_TEST_CHROMIUM")
    if named:
        return named
    for candidate in ("chromium", "chromium-browser", "/usr/bin/chromium"):
        found = shutil.which(candidate)
        if found:
            return found
    return None


def browser() -> Iterator[Any]:
    """A started headless Chromium; the test is skipped, saying why, when none can start."""
    try:
        from playwright.sync_api import Error, sync_playwright  # noqa: PLC0415
    except ImportError:
        pytest.skip("Playwright is not installed: pip install 'outbound-dispatcher[test]'")
    path = chromium_path()
    if path is None:
        pytest.skip(
            "no Chromium to drive: apt-get install chromium (or set OUTBOUND_TEST_CHROMIUM)"
        )
    playwright = sync_playwright().start()
    try:
        try:
            launched = playwright.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        except Error as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            pytest.skip(f"Chromium at {path} cannot be started: {first}")
        try:
            yield launched
        finally:
            launched.close()
    finally:
        playwright.stop()


def png_size(path: Path) -> tuple[int, int]:
    """The width and height of a PNG file (checked to be one)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def screenshot(page: Any, name: str, tmp_path: Path, **options: Any) -> Path:
    """Take a screenshot of ``page``: into ``OUTBOUND_SCREENSHOTS`` when set, else ``tmp_path``.

    Checked to be a PNG of the page's width. Returns where it is.
    """
    folder = os.environ.get("OUTBOUND_SCREENSHOTS")
    target = Path(folder) / name if folder else tmp_path / name
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written here: with path=, Playwright writes on a thread of its own
    # that outlives the test.
    target.write_bytes(page.screenshot(**options))
    width, height = png_size(target)
    assert width == page.viewport_size["width"]
    assert height > 100
    return target
