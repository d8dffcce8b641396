"""PrometheusMetrics in prometheus_client's multiprocess mode (the gunicorn setup its
docstring describes): a forked child sends though a parent thread was updating a
metric at the fork. prometheus_client's multiprocess values share one lock, which
a parent thread could hold at the fork; it is held across the fork, so the child's
copy is free."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytest.importorskip("prometheus_client")
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

SCRIPT = textwrap.dedent(
    r"""
    import os, signal, sys, threading, time, warnings
    warnings.simplefilter("ignore")
    sys.setswitchinterval(1e-6)
    import prometheus_client
    from outbound import Dispatcher, Outbound
    from outbound.contrib.prometheus import PrometheusMetrics
    from outbound.messages import SendRequest, SendResult, TextMessage

    class Sent:
        def send(self, request):
            return SendResult(1, {"ok": True})

    prom = PrometheusMetrics(registry=prometheus_client.CollectorRegistry())
    sender = prom.middleware()(Sent())
    stop = threading.Event()

    def parent_sending():  # a parent that may be sending (README, Pre-fork servers)
        request = SendRequest(1, TextMessage("x"))
        while not stop.is_set():
            sender.send(request)

    threads = [threading.Thread(target=parent_sending) for _ in range(2)]
    for t in threads:
        t.start()
    hung = 0
    forks = 0
    deadline = time.monotonic() + 20
    with Dispatcher(hooks=prom.hooks()) as dispatcher:
        out = Outbound(dispatcher, sender)
        while forks < 40 and not hung and time.monotonic() < deadline:
            forks += 1
            pid = os.fork()
            if pid == 0:  # the child: one reply, waited for with a timeout
                signal.alarm(10)  # a backstop only
                ok = False
                try:
                    ok = out.reply_text(2, "child").result(timeout=3).message_id == 1
                except BaseException:
                    ok = False
                os._exit(0 if ok else 1)
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                hung += 1
        stop.set()
        for t in threads:
            t.join(10)
    print(f"forks={forks} hung={hung}")
    """
)


def test_a_forked_child_sends_though_a_parent_thread_was_updating_a_metric() -> None:
    with tempfile.TemporaryDirectory() as multiproc_dir:
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=multiproc_dir)
        run = subprocess.run(  # noqa: PLW1510 (the code is checked below)
            [sys.executable, "-c", SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("hung=0"), (
        f"a forked child's reply never resolved: {run.stdout.strip()}"
    )
