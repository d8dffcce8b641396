"""PrometheusMetrics without multiprocess mode: a child forked while a parent thread
was updating a metric waits for good on that metric's lock.

README "Pre-fork servers": "The locks of the sending chain (rate limiters, metrics,
senders) are made new in the child too: one a parent thread held at the fork would
otherwise stay held there for good." outbound/contrib/prometheus.py frees only the one
lock prometheus_client shares in multiprocess mode (_guard_at_fork) and pre-builds the
labelled children so that labels() is never called; but in the default (single
process) mode every value is a prometheus_client.values.MutexValue with a
threading.Lock of its own, taken by each inc()/observe(), and nothing renews it. The
parent's thread that was inside ``Counter.inc`` (the ``on_queued`` hook of a submit, the
middleware's ``inflight`` gauge) does not exist in the child.

Each case holds one metric's lock in another parent thread (``acquire``, as a thread
inside ``inc()`` holds it), forks, and has the child send through the same Outbound,
every wait bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("prometheus_client")
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

SCRIPT = textwrap.dedent(
    r"""
    import json, os, select, sys, threading
    import prometheus_client
    from outbound import Dispatcher, Outbound, middleware
    from outbound.messages import SendResult
    from outbound.contrib.prometheus import PrometheusMetrics

    class Sent:
        def send(self, request):
            return SendResult(1, {"ok": True})

    prom = PrometheusMetrics(prometheus_client.CollectorRegistry())
    sender = middleware.chain(prom.middleware(), middleware.retry(), middleware.timeout())(Sent())
    ob = Outbound(Dispatcher(hooks=prom.hooks()), sender)
    assert ob.reply_text(1, "parent").result(10).message_id == 1   # used before the fork

    metric = {"submitted": prom._submitted, "inflight": prom._inflight}[sys.argv[1]]
    lock = metric._value._lock   # what inc() holds while it adds
    holding, done = threading.Event(), threading.Event()

    def hold():
        with lock:
            holding.set()
            done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(10)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            result = []
            def child_send():
                try:
                    result.append(ob.reply_text(2, "child").result(timeout=5).message_id)
                except BaseException as exc:
                    result.append(repr(exc))
            t = threading.Thread(target=child_send, daemon=True)
            t.start()
            t.join(10)
            word = result[0] if result else "reply_text() still blocked after 10 s"
            os.write(w, json.dumps(word).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    done.set()
    holder.join(10)
    ready, _, _ = select.select([r], [], [], 30)
    child = json.loads(os.read(r, 4096) or b"null") if ready else "no word from the child"
    os.waitpid(pid, 0)
    parent = ob.reply_text(3, "parent again").result(10).message_id
    print(json.dumps({"child": child, "parent": parent}))
    """
)


@pytest.mark.parametrize("held", ["submitted", "inflight"])
def test_a_child_sends_though_a_parent_thread_was_updating_a_metric(held: str) -> None:
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    proc = subprocess.run(  # noqa: PLW1510 - the exit code is checked below
        [sys.executable, "-c", SCRIPT, held], capture_output=True, text=True, timeout=90, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["parent"] == 1, out
    assert out["child"] == 1, f"the child could not send ({held} lock held at the fork): {out}"
