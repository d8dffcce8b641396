"""PrometheusMetrics refuses, when built, settings that would break a scrape: bucket
bounds with NaN (``le="NaN"``, which the OpenMetrics parser refuses) or a repeated
bound (two series of one bucket), and a namespace with ":" (prometheus_client then
writes names its own OpenMetrics parser refuses), as ``metrics()`` refuses its own."""

from __future__ import annotations

import math

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from outbound.contrib.prometheus import PrometheusMetrics  # noqa: E402
from outbound.middleware import metrics  # noqa: E402


@pytest.mark.parametrize("bounds", [(0.1, math.nan), (1.0, 1.0), (2.0, 1.0), ()])
def test_bad_bucket_bounds_are_refused_when_built(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="buckets must be"):
        metrics(buckets=bounds)
    registry = prometheus_client.CollectorRegistry()
    with pytest.raises(ValueError, match=r"^buckets must be"):
        PrometheusMetrics(registry=registry, buckets=bounds)
    with pytest.raises(ValueError, match=r"^wait_buckets must be"):
        PrometheusMetrics(registry=registry, wait_buckets=bounds)
    # nothing was registered: a good one goes on the same registry
    PrometheusMetrics(registry=registry).unregister()


def test_a_namespace_with_a_colon_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match="namespace"):
        PrometheusMetrics(registry=prometheus_client.CollectorRegistry(), namespace="bot:outbound")
