"""FlaskOutbound(hooks=...) refuses, when built, a value that is not an
outbound.Hooks (the PrometheusMetrics object, or ``prom.hooks`` not called), which
would otherwise fail every reply later."""

from __future__ import annotations

import pytest

flask = pytest.importorskip("flask")
prometheus_client = pytest.importorskip("prometheus_client")

from outbound.contrib.flask import Outbound  # noqa: E402
from outbound.contrib.prometheus import PrometheusMetrics  # noqa: E402
from outbound.messages import SendRequest, SendResult  # noqa: E402


class Sent:
    def send(self, request: SendRequest) -> SendResult:
        return SendResult(1)


@pytest.mark.parametrize("kind", ["unbound hooks method", "metrics object"])
def test_bad_hooks_are_refused_at_construction(kind: str) -> None:
    prom = PrometheusMetrics(registry=prometheus_client.CollectorRegistry())
    bad = prom.hooks if kind == "unbound hooks method" else prom
    try:
        ext = Outbound(sender_factory=lambda app: Sent(), hooks=bad)  # type: ignore[arg-type]
        app = flask.Flask("shop")
        ext.init_app(app)
    except TypeError:
        return  # refused at once: what should happen
    with app.app_context():
        error = ext.reply_text(1, "hello").exception(timeout=10)
    ext.shutdown(5, app=app)
    pytest.fail(
        f"hooks={bad!r} was accepted by the constructor and init_app; "
        f"the first reply then failed with {error!r}"
    )
