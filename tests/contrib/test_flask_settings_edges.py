"""FlaskOutbound at the edges: OUTBOUND_* values that init_app must refuse naming the
key (a URL's bad port or unclosed bracket, a seconds value too large for a float),
and shutdown_all reaching the dispatcher of an app that was dropped and collected
(one a test's app factory made)."""

from __future__ import annotations

import gc
import math
import weakref
from typing import Any

import pytest

pytest.importorskip("flask")

from flask import Flask

from outbound.contrib.flask import Outbound, shutdown_all
from outbound.simulator import Fault, PlatformSimulator


def _app(key: str, value: Any) -> Flask:
    app = Flask("outbound_edges")
    app.config["OUTBOUND_TELEGRAM_TOKEN"] = "123456:ABC"
    app.config[key] = value
    return app


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:99999",
        "http://127.0.0.1:abc",
        "http://127.0.0.1:-1",
        "http://[::1",
        # (taken, then every send failed)
        "http://a b/",
        "http://127.0.0.1:8081/api?x=1",
    ],
)
def test_a_url_with_a_bad_port_or_bracket_is_refused_naming_the_key(url: str) -> None:
    with pytest.raises(ValueError, match="OUTBOUND_TELEGRAM_URL"):
        Outbound().init_app(_app("OUTBOUND_TELEGRAM_URL", url))


def test_a_shutdown_timeout_too_large_for_a_float_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="OUTBOUND_SHUTDOWN_TIMEOUT"):
        Outbound().init_app(_app("OUTBOUND_SHUTDOWN_TIMEOUT", 10**400))


def test_a_send_timeout_too_large_for_a_float_is_no_deadline() -> None:
    app = _app("OUTBOUND_SEND_TIMEOUT", 10**400)
    ext = Outbound()
    ext.init_app(app)
    assert app.extensions["outbound"].settings.send_timeout == math.inf


def test_shutdown_all_reaches_the_dispatcher_of_an_app_collected() -> None:
    ext = Outbound()
    with PlatformSimulator() as sim:
        app = Flask("outbound_dropped")
        app.config.update(
            OUTBOUND_TELEGRAM_TOKEN=sim.token,
            OUTBOUND_TELEGRAM_URL=sim.url,
            OUTBOUND_RATE_LIMITS="none",
            OUTBOUND_MAX_INFLIGHT=1,
            OUTBOUND_SEND_TIMEOUT=3.0,
            OUTBOUND_MAX_ATTEMPTS=1,
        )
        ext.init_app(app)
        sim.inject(Fault("slow", delay=2.0))
        with app.app_context():
            futures = [ext.reply_text(7, f"m{i}") for i in range(3)]
        app_ref = weakref.ref(app)
        del app
        gc.collect()
        assert app_ref() is None  # the app is gone; its dispatcher is not
        try:
            assert shutdown_all(0.2) is False  # replies were left: given up
            assert all(f.done() for f in futures[1:])  # the queued ones cancelled
            assert all(f.cancelled() for f in futures[1:])
        finally:
            for f in futures:
                f.cancel()
            for f in futures:
                if not f.cancelled():
                    f.exception(timeout=10)
