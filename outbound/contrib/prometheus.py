"""Prometheus metrics for outbound: :class:`PrometheusMetrics` (extra ``prometheus``).

::

    prom = PrometheusMetrics()                       # or registry=CollectorRegistry()
    dispatcher = Dispatcher(hooks=prom.hooks())
    sender = chain(prom.middleware(), logging(), retry(), rate_limit(TELEGRAM), timeout())(
        TelegramSender(token)
    )
    prom.watch_dispatcher(dispatcher)                # read at scrape time
    prom.watch_outbox(store)                         # one status() query per scrape

No metric has a per-chat (or per-key) label: label values come from small
fixed sets. With the default ``namespace="outbound"``:

From :meth:`~PrometheusMetrics.middleware` (put it outermost, as
:func:`outbound.middleware.metrics`, so that it sees every run of a send):

- ``outbound_messages_sent_total{result}``: runs of a send by how they
  ended: ``sent``; ``failed`` (raised to the caller: the message's final
  failure); ``rate_limited`` (a 429, to be tried again after
  ``retry_after``); ``retried`` (a transient error, to be tried again);
  ``throttled`` (the client-side rate limiter said "not yet").
- ``outbound_send_failures_total{error}``: the ``failed`` runs by kind:
  ``permanent``, ``transient``, ``timeout``, ``expired``
  (:class:`~outbound.errors.MessageExpired`: past ``max_total``),
  ``rate_limited``, ``cancelled``, ``invalid``
  (``TypeError``/``ValueError``), ``other``.
- ``outbound_rate_limited_total{scope}``: :class:`~outbound.errors.RateLimited`
  errors by scope (``chat`` or ``global``), retried or not: the platform's
  429s (one that made the message expire too), and outside a dispatcher
  task the client-side limiter's refusals.
- ``outbound_send_duration_seconds``: histogram of the time each run took
  below the middleware (throttled runs, which send nothing, excluded).
- ``outbound_delivery_seconds``: histogram of the time from ``submit`` to
  sent, for each message sent inside a dispatcher task.
- ``outbound_inflight``: gauge of the sends in progress.

From :meth:`~PrometheusMetrics.hooks`:

- ``outbound_queue_wait_seconds``: histogram of ``DispatchInfo.queue_latency``
  (from ``submit`` to the start of the task's last run).
- ``outbound_task_duration_seconds``: histogram of ``DispatchInfo.run_latency``.
- ``outbound_tasks_submitted_total``; ``outbound_tasks_total{outcome}``
  (``ok``, ``error``, ``cancelled``: a task that raised ``CancelledError``;
  tasks cancelled by ``force_close`` or ``shutdown(cancel_futures=True)``
  get no ``on_done`` and are not counted, so after those the outcomes add
  up to fewer than were submitted); ``outbound_tasks_rejected_total{reason}``
  (``queue_full``, ``closed``).

Read at scrape time from each watched dispatcher's ``stats()`` (summed over
them): ``outbound_queued``, ``outbound_running``, ``outbound_lanes``,
``outbound_parked_lanes``, ``outbound_threads``, ``outbound_idle_threads``,
``outbound_max_inflight``. From each watched outbox store's ``status()``
(summed): ``outbound_outbox_pending``, ``outbound_outbox_processing``,
``outbound_outbox_sent``, ``outbound_outbox_dead``, and
``outbound_outbox_oldest_pending_age_seconds`` (the largest). Watch each
outbox table once: two stores on one table count its rows twice.

Multiprocess mode (gunicorn, uWSGI: several processes behind one scrape)
with ``prometheus_client``'s ``PROMETHEUS_MULTIPROC_DIR``:

- Set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory before
  ``prometheus_client`` is first imported, in every process, and empty it
  when the server starts. Serve ``/metrics`` from a fresh
  ``CollectorRegistry()`` passed to
  ``prometheus_client.multiprocess.MultiProcessCollector(registry)``.
- The counters, histograms and ``outbound_inflight`` (built with
  ``multiprocess_mode="livesum"``: the sum over live processes) are
  written to that directory by every process and summed at scrape time.
- Under gunicorn, mark a dead worker's gauges in ``gunicorn.conf.py``::

      from prometheus_client import multiprocess

      def child_exit(server, worker):
          multiprocess.mark_process_dead(worker.pid)

- What :meth:`~PrometheusMetrics.watch_dispatcher` reports is not shared
  between processes: a dispatcher's gauges describe the one process that
  answers the scrape. Do not use it in multiprocess mode; rely on the
  counters and histograms. :meth:`~PrometheusMetrics.watch_outbox` reads
  the database, the same from any process: in multiprocess mode build a
  second ``PrometheusMetrics`` on the scrape registry for it, in the
  process that serves ``/metrics`` only (each process that watched the
  outbox would report the same rows).

Every method is thread-safe. Updating a metric never blocks; a scrape
calls ``stats()`` on each watched dispatcher (quick) and ``status()`` on
each watched store (one query; a store that fails is logged and left out
of that scrape).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import CancelledError
from typing import Any, Final

try:
    import prometheus_client
    import prometheus_client.values
    from prometheus_client import Counter, Gauge, Histogram
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "outbound.contrib.prometheus needs prometheus_client: "
        "pip install 'outbound-dispatcher[prometheus]'"
    ) from exc

from outbound._fork import renewed_after_fork
from outbound.context import Defer, current_context
from outbound.dispatcher import Dispatcher
from outbound.errors import (
    DispatcherClosed,
    MessageExpired,
    PermanentSendError,
    QueueFull,
    RateLimited,
    SendTimeout,
    TransientSendError,
)
from outbound.hooks import DispatchInfo, Hooks
from outbound.messages import Sender, SendRequest, SendResult
from outbound.middleware import (
    DEFAULT_BUCKETS,
    SenderDecorator,
    _answered_429,
    _check_buckets,
    _Wrapper,
)
from outbound.outbox import Store

__all__ = ["WAIT_BUCKETS", "PrometheusMetrics"]


def _multiprocess_lock() -> Any:
    """The one lock every value of ``prometheus_client`` shares in multiprocess mode
    (a variable of the function that made its value class), or None."""
    value_class = getattr(prometheus_client.values, "ValueClass", None)
    for method in ("inc", "set", "get"):
        cells = getattr(getattr(value_class, method, None), "__closure__", None) or ()
        for cell in cells:
            try:
                found = cell.cell_contents
            except ValueError:  # (a cell not filled yet)
                continue
            if isinstance(found, _LOCK_TYPE):
                return found
    return None


_LOCK_TYPE = type(threading.Lock())
# The ids of the locks guarded (one in a process, in practice); guarded by _GUARDING.
_FORK_GUARDED: set[int] = set()
_GUARDING = renewed_after_fork(threading.Lock())


def _guard_at_fork() -> None:
    """Free ``prometheus_client``'s multiprocess lock in the child of a fork.

    Every value takes that one lock to update its file; a thread that held it
    when another forked would leave it held for good in the child, whose
    first update (an ``on_queued`` hook in ``reply_text``, a send) would
    then wait forever. ``prometheus_client`` renews no lock at a fork. Not
    held across the fork: a fork made while the forking thread holds it (from
    a signal handler) would wait for itself. What it guarded is not used in
    the child as it was: a value there sees its process id changed and
    starts its file anew.
    """
    lock = _multiprocess_lock()
    reinit = getattr(lock, "_at_fork_reinit", None)
    if reinit is None or not hasattr(os, "register_at_fork"):
        return
    with _GUARDING:
        if id(lock) in _FORK_GUARDED:
            return
        _FORK_GUARDED.add(id(lock))
        os.register_at_fork(after_in_child=reinit)


def _renew_locks_at_fork(metric: object) -> None:
    """Have every lock of ``metric``, its labelled children and their values made
    new in a forked child.

    Outside multiprocess mode each value of ``prometheus_client`` has a lock
    of its own, taken at every update, and the library renews none at a
    fork: one a parent thread held then would stop the child's first update
    (an ``on_queued`` hook in ``reply_text``, a send) for good. The children
    are made before this runs (see PrometheusMetrics), so none comes later.
    """
    children: list[object] = [metric, *getattr(metric, "_metrics", {}).values()]
    for child in children:
        found: list[object] = [getattr(child, "_lock", None)]
        for value in getattr(child, "__dict__", {}).values():
            for item in value if isinstance(value, list) else [value]:
                found.append(getattr(item, "_lock", None))
        for lock in found:
            if isinstance(lock, _LOCK_TYPE):
                renewed_after_fork(lock)


logger = logging.getLogger("outbound.contrib.prometheus")

#: Upper bounds (seconds) of the buckets of the queue-wait and delivery
#: histograms: a message may wait out rate limits for minutes.
WAIT_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip

# (No ":": Prometheus keeps it for recording rules, and prometheus_client writes
# a name with one that its own OpenMetrics parser refuses.)
_NAMESPACE = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)?")
_RESULTS = ("sent", "failed", "rate_limited", "retried", "throttled")
_FAILURES = (
    "permanent",
    "transient",
    "timeout",
    "expired",
    "rate_limited",
    "cancelled",
    "invalid",
    "other",
)
_SCOPES = ("chat", "global")
_OUTCOMES = ("ok", "error", "cancelled")
_REJECTIONS = ("queue_full", "closed")
_DISPATCHER_GAUGES = (
    ("queued", "Tasks accepted and not yet started (parked ones included)."),
    ("running", "Worker threads busy with a task."),
    ("lanes", "Lanes (keys) that hold work."),
    ("parked_lanes", "Lanes waiting on the timer (a retry_after, a rate limit)."),
    ("threads", "Live worker threads."),
    ("idle_threads", "Worker threads waiting for work."),
    ("max_inflight", "The most tasks that may run at once."),
)
_OUTBOX_STATUSES = ("pending", "processing", "sent", "dead")

_monotonic = time.monotonic


def _failure_kind(error: BaseException) -> str:
    if isinstance(error, MessageExpired):
        return "expired"
    if isinstance(error, SendTimeout):
        return "timeout"
    if isinstance(error, RateLimited):
        return "rate_limited"
    if isinstance(error, TransientSendError):
        return "transient"
    if isinstance(error, PermanentSendError):
        return "permanent"
    if isinstance(error, CancelledError):
        return "cancelled"
    if isinstance(error, (TypeError, ValueError)):
        return "invalid"
    return "other"


class PrometheusMetrics:
    """Prometheus metrics of sends, dispatchers and outboxes (see the module docstring).

    - ``registry``: where the metrics are registered (default
      ``prometheus_client.REGISTRY``). Two instances on one registry clash
      (``ValueError``, nothing registered); use one per registry.
    - ``namespace``: the prefix of every name (``""``: none).
    - ``buckets``: bounds (seconds) of ``send_duration_seconds`` and
      ``task_duration_seconds``; ``wait_buckets`` those of
      ``queue_wait_seconds`` and ``delivery_seconds``.

    Thread-safe; nothing blocks but a scrape (see the module docstring).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        namespace: str = "outbound",
        *,
        buckets: Iterable[float] = DEFAULT_BUCKETS,
        wait_buckets: Iterable[float] = WAIT_BUCKETS,
    ) -> None:
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise ValueError(f"namespace must be a Prometheus name or '', not {namespace!r}")
        _guard_at_fork()
        self._registry: Final = prometheus_client.REGISTRY if registry is None else registry
        self._namespace: Final = namespace
        ns = namespace
        send_bounds = _check_buckets("buckets", buckets)
        wait_bounds = _check_buckets("wait_buckets", wait_buckets)
        self._sent: Final = Counter(
            "messages_sent",
            "Runs of a send, by how they ended.",
            ["result"],
            namespace=ns,
            registry=None,
        )
        self._failures: Final = Counter(
            "send_failures",
            "Sends that failed for good, by kind of error.",
            ["error"],
            namespace=ns,
            registry=None,
        )
        self._rate_limited: Final = Counter(
            "rate_limited",
            "429 answers of the platform, by scope.",
            ["scope"],
            namespace=ns,
            registry=None,
        )
        self._send_seconds: Final = Histogram(
            "send_duration_seconds",
            "Time each run of a send took, throttled runs excluded.",
            namespace=ns,
            registry=None,
            buckets=send_bounds,
        )
        self._delivery_seconds: Final = Histogram(
            "delivery_seconds",
            "Time from submit to sent, for each message sent in a dispatcher task.",
            namespace=ns,
            registry=None,
            buckets=wait_bounds,
        )
        self._inflight: Final = Gauge(
            "inflight",
            "Sends in progress.",
            namespace=ns,
            registry=None,
            multiprocess_mode="livesum",
        )
        self._queue_wait: Final = Histogram(
            "queue_wait_seconds",
            "Time from submit to the start of a task's last run.",
            namespace=ns,
            registry=None,
            buckets=wait_bounds,
        )
        self._task_seconds: Final = Histogram(
            "task_duration_seconds",
            "Time the last run of each task took.",
            namespace=ns,
            registry=None,
            buckets=send_bounds,
        )
        self._submitted: Final = Counter(
            "tasks_submitted", "Tasks accepted by a dispatcher.", namespace=ns, registry=None
        )
        self._tasks: Final = Counter(
            "tasks", "Tasks finished, by outcome.", ["outcome"], namespace=ns, registry=None
        )
        self._rejected: Final = Counter(
            "tasks_rejected",
            "Tasks a dispatcher refused, by reason.",
            ["reason"],
            namespace=ns,
            registry=None,
        )
        # Every labelled child made once, here, and used as made: labels()
        # takes the metric's own lock, which a forked child would inherit held
        # if a parent thread was in it (prometheus_client renews none).
        self._sent_by: Final = {value: self._sent.labels(value) for value in _RESULTS}
        self._failures_by: Final = {value: self._failures.labels(value) for value in _FAILURES}
        self._rate_limited_by: Final = {
            value: self._rate_limited.labels(value) for value in _SCOPES
        }
        self._tasks_by: Final = {value: self._tasks.labels(value) for value in _OUTCOMES}
        self._rejected_by: Final = {value: self._rejected.labels(value) for value in _REJECTIONS}
        # Guards _dispatchers and _stores; held only to copy or change them.
        self._lock: Final = renewed_after_fork(threading.Lock())
        metrics: list[Collector] = [
            self._sent,
            self._failures,
            self._rate_limited,
            self._send_seconds,
            self._delivery_seconds,
            self._inflight,
            self._queue_wait,
            self._task_seconds,
            self._submitted,
            self._tasks,
            self._rejected,
        ]
        for metric in metrics:
            _renew_locks_at_fork(metric)
        registry_lock = getattr(self._registry, "_lock", None)  # taken by scrapes
        if callable(getattr(registry_lock, "_at_fork_reinit", None)):  # a Lock, an RLock
            renewed_after_fork(registry_lock)
        self._dispatchers: list[Dispatcher] = []
        self._stores: list[Store] = []
        self._state: Final = _StateCollector(self)
        collectors = [*metrics, self._state]
        done: list[Collector] = []
        try:
            for collector in collectors:
                self._registry.register(collector)
                done.append(collector)
        except BaseException:
            for collector in done:
                self._registry.unregister(collector)
            raise
        self._collectors: Final = tuple(collectors)

    @property
    def registry(self) -> CollectorRegistry:
        return self._registry

    @property
    def namespace(self) -> str:
        return self._namespace

    def _name(self, name: str) -> str:
        return f"{self._namespace}_{name}" if self._namespace else name

    def unregister(self) -> None:
        """Remove every metric of this instance from its registry. Idempotent."""
        for collector in self._collectors:
            try:
                self._registry.unregister(collector)
            except KeyError:
                pass

    def __repr__(self) -> str:
        with self._lock:
            d, s = len(self._dispatchers), len(self._stores)
        return f"<PrometheusMetrics namespace={self._namespace!r} dispatchers={d} outboxes={s}>"

    # ----------------------------------------------------------- middleware

    def middleware(self) -> SenderDecorator:
        """A sender decorator that counts and times every run of a send.

        Put it outermost in :func:`outbound.middleware.chain`. The sender it
        returns forwards ``validate`` and is thread-safe if the wrapped one is.
        """

        def decorate(sender: Sender) -> Sender:
            return _PrometheusSender(sender, self)

        return decorate

    # ----------------------------------------------------------------- hooks

    def hooks(self, hooks: Hooks | None = None) -> Hooks:
        """:class:`~outbound.Hooks` for a dispatcher that feed the task metrics.

        With ``hooks``, each of its callbacks still runs, after the
        metrics are updated (what it raises is logged by the dispatcher, as
        always).
        """
        if hooks is not None and not isinstance(hooks, Hooks):
            raise TypeError(f"hooks must be an outbound.Hooks, not {type(hooks).__name__}")
        base = hooks if hooks is not None else Hooks()
        return Hooks(
            on_queued=_then(self._on_queued, base.on_queued),
            on_start=base.on_start,
            on_done=_then(self._on_done, base.on_done),
            on_rejected=_then(self._on_rejected, base.on_rejected),
        )

    def _on_queued(self, key: Hashable, queue_len: int) -> None:
        self._submitted.inc()

    def _on_done(self, info: DispatchInfo) -> None:
        self._queue_wait.observe(max(0.0, info.queue_latency))
        self._task_seconds.observe(max(0.0, info.run_latency))
        error = info.error
        if error is None:
            outcome = "ok"
        elif isinstance(error, CancelledError):
            outcome = "cancelled"
        else:
            outcome = "error"
        self._tasks_by[outcome].inc()

    def _on_rejected(self, key: Hashable, error: BaseException) -> None:
        if isinstance(error, QueueFull):
            self._rejected_by["queue_full"].inc()
        elif isinstance(error, DispatcherClosed):
            self._rejected_by["closed"].inc()

    # ------------------------------------------------------------- watching

    def watch_dispatcher(self, dispatcher: Dispatcher) -> None:
        """Report ``dispatcher.stats()`` at each scrape, until :meth:`unwatch`. Idempotent."""
        if not isinstance(dispatcher, Dispatcher):
            raise TypeError(f"expected an outbound.Dispatcher, not {type(dispatcher).__name__}")
        with self._lock:
            if not any(d is dispatcher for d in self._dispatchers):
                self._dispatchers.append(dispatcher)

    def watch_outbox(self, store: Store) -> None:
        """Report ``store.status()`` at each scrape, until :meth:`unwatch`. Idempotent."""
        if not isinstance(store, Store):
            raise TypeError(f"expected an outbox Store, not {type(store).__name__}")
        with self._lock:
            if not any(s is store for s in self._stores):
                self._stores.append(store)

    def unwatch(self, watched: Dispatcher | Store) -> None:
        """Stop reporting a watched dispatcher or store. Does nothing if it is not watched."""
        with self._lock:
            self._dispatchers = [d for d in self._dispatchers if d is not watched]
            self._stores = [s for s in self._stores if s is not watched]

    def _collect_state(self) -> Iterator[Metric]:
        with self._lock:
            dispatchers = list(self._dispatchers)
            stores = list(self._stores)
        if dispatchers:
            totals = dict.fromkeys((name for name, _ in _DISPATCHER_GAUGES), 0)
            for dispatcher in dispatchers:
                s = dispatcher.stats()
                totals["queued"] += s.queued
                totals["running"] += s.running
                totals["lanes"] += s.lanes
                totals["parked_lanes"] += s.parked
                totals["threads"] += s.threads
                totals["idle_threads"] += s.idle_threads
                totals["max_inflight"] += s.max_inflight
            for name, doc in _DISPATCHER_GAUGES:
                yield GaugeMetricFamily(self._name(name), doc, value=totals[name])
        if stores:
            counts = dict.fromkeys(_OUTBOX_STATUSES, 0)
            oldest: float | None = None
            read = 0
            for store in stores:
                try:
                    status = store.status()
                except Exception:
                    logger.warning("outbox %r: status() failed; left out of this scrape", store)
                    continue
                read += 1
                for name in _OUTBOX_STATUSES:
                    counts[name] += int(status.counts.get(name, 0))
                age = status.oldest_pending_age
                if age is not None and (oldest is None or age > oldest):
                    oldest = age
            if read:
                for name in _OUTBOX_STATUSES:
                    yield GaugeMetricFamily(
                        self._name(f"outbox_{name}"),
                        f"Outbox rows with status {name}.",
                        value=counts[name],
                    )
                if oldest is not None:
                    yield GaugeMetricFamily(
                        self._name("outbox_oldest_pending_age_seconds"),
                        "Age of the oldest pending outbox row.",
                        value=oldest,
                    )

    def _describe_state(self) -> Iterator[Metric]:
        for name, doc in _DISPATCHER_GAUGES:
            yield GaugeMetricFamily(self._name(name), doc)
        for name in _OUTBOX_STATUSES:
            yield GaugeMetricFamily(
                self._name(f"outbox_{name}"), f"Outbox rows with status {name}."
            )
        yield GaugeMetricFamily(
            self._name("outbox_oldest_pending_age_seconds"), "Age of the oldest pending outbox row."
        )


class _StateCollector(Collector):
    """Reads the watched dispatchers and stores at scrape time."""

    def __init__(self, owner: PrometheusMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterable[Metric]:
        return self._owner._collect_state()

    def describe(self) -> Iterable[Metric]:
        return self._owner._describe_state()


def _then(
    first: Callable[..., object], second: Callable[..., object] | None
) -> Callable[..., object]:
    if second is None:
        return first

    def both(*args: object) -> None:
        first(*args)
        second(*args)

    return both


class _PrometheusSender(_Wrapper):
    # A _Wrapper: it forwards validate and chat_key too. Without chat_key, a
    # chain with this outermost lost the sender's ("@Chan" and "@chan" are
    # one Telegram chat): one chat had two lanes, and its messages went out
    # of order.
    __slots__ = ("_metrics",)

    def __init__(self, inner: Sender, metrics: PrometheusMetrics) -> None:
        super().__init__(inner)
        self._metrics: Final = metrics

    def send(self, request: SendRequest) -> SendResult:
        m = self._metrics
        m._inflight.inc()
        start = _monotonic()
        try:
            result = self._inner.send(request)
        except Defer as defer:
            cause = defer.__cause__
            if isinstance(cause, RateLimited):
                m._sent_by["rate_limited"].inc()
                m._rate_limited_by[cause.scope].inc()
                m._send_seconds.observe(_monotonic() - start)
            elif isinstance(cause, Exception):
                m._sent_by["retried"].inc()
                m._send_seconds.observe(_monotonic() - start)
            else:
                m._sent_by["throttled"].inc()
            raise
        except BaseException as error:
            m._send_seconds.observe(_monotonic() - start)
            m._sent_by["failed"].inc()
            m._failures_by[_failure_kind(error)].inc()
            # Client-side refusals too (see the module docstring).
            limited = error if isinstance(error, RateLimited) else _answered_429(error)
            if limited is not None:
                m._rate_limited_by[limited.scope].inc()
            raise
        finally:
            m._inflight.dec()
        end = _monotonic()
        m._send_seconds.observe(end - start)
        m._sent_by["sent"].inc()
        try:
            submitted = current_context().submitted_at
        except RuntimeError:
            pass
        else:
            m._delivery_seconds.observe(max(0.0, end - submitted))
        return result

    def __repr__(self) -> str:
        return f"<_PrometheusSender of {self._inner!r}>"
