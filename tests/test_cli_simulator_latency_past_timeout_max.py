"""A stand-in latency (or slow_delay) past threading.TIMEOUT_MAX is refused or
waited until the simulator stops; the demo refuses a latency past an hour."""

import http.client
import socket
import urllib.error
import urllib.request
from typing import Any

import pytest

from outbound.simulator import PlatformSimulator, SimulatorConfig


@pytest.mark.parametrize("field", ["latency", "slow_delay"])
def test_latency_longer_than_timeout_max_is_refused_or_waited(field: str) -> None:
    kwargs: dict[str, Any] = {field: 1e10}
    if field == "slow_delay":
        kwargs["slow_rate"] = 1.0
    try:
        config = SimulatorConfig(**kwargs)
    except ValueError:
        return  # refused up front: fine
    with PlatformSimulator(config) as sim:
        url = f"{sim.url}/bot{sim.token}/sendMessage?chat_id=1&text=hi"
        try:
            urllib.request.urlopen(url, timeout=2)
        except TimeoutError:
            return  # still waiting, as a platform that is slow: fine
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                return
            raise AssertionError(f"the platform dropped the request at once: {exc!r}") from exc
        except (http.client.RemoteDisconnected, ConnectionResetError) as exc:
            raise AssertionError(
                f"the platform dropped the request at once ({exc!r}); "
                f"it counted it delivered: {sim.stats().delivered}"
            ) from exc
        raise AssertionError("answered although the latency is 1e10 s")
