"""Sender middleware: small decorators composed around a platform sender.

A :data:`SenderDecorator` takes a :class:`~outbound.messages.Sender` and
returns one. :func:`chain` composes them, first outermost::

    metered = metrics()
    sender = chain(
        metered,                          # Metrics
        logging(),                        # Logging
        retry(max_attempts=5),            # Retry
        rate_limit(ratelimit.TELEGRAM),   # RateLimit
        timeout(10.0),                    # Timeout
    )(TelegramSender(token))              # platform sender

The documented order is Metrics → Logging → Retry → RateLimit → Timeout →
platform sender, and each place has a reason:

- **Metrics** is outermost so that it sees exactly what the dispatcher
  sees: each run of the send ends once, as sent, failed, or deferred (and
  why), and its latency includes everything below.
- **Logging** comes next, so that it logs one line per run with the
  decision the layers below took (sent, retrying in 2 s after a 503, given
  up), not each internal step.
- **Retry** sits above RateLimit so that a retried send is paced again
  like any other, and so that a local "not yet" (a :class:`~outbound.Defer`)
  is never mistaken for a failure and never spends an attempt.
- **RateLimit** sits above Timeout so that waiting for a slot is not
  charged to the send's I/O time, and so that no request is started
  that the limiter would refuse; and below Retry so that every 429 is
  recorded in the limiter (the chat, or the bot, waits it out for every
  later message) before Retry decides what becomes of this one.
- **Timeout** is innermost: it bounds exactly the platform call, turning
  the task's remaining time (and its own ``seconds``) into the deadline
  the platform sender turns into socket timeouts.

Waiting never holds a thread. Inside a dispatcher task, ``retry`` and
``rate_limit`` never sleep: they raise :class:`~outbound.Defer`, the
dispatcher puts the task back at the head of its lane, parks the lane
and runs the whole task again from the top when the time comes. A
platform-wide 429 is recorded in the rate limiter, which then holds back
every chat of that limiter (one bot), and no other; only a chain without
a rate limiter pauses every lane of the dispatcher instead. No
middleware keeps state per message: what a message has been through is
in its task (:func:`~outbound.current_context`: ``attempt``,
``submitted_at``), and the count of failed sends in its ``state``, which
the dispatcher keeps across the runs of one task. Outside a dispatcher
task no deferral is possible, and nothing sleeps either: the error is
raised to the caller.

Every decorator returns a sender that is thread-safe if the sender it
wraps is, and that forwards ``validate(request)`` to it.
"""

from __future__ import annotations

import itertools
import logging as _logging
import math
import random
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

from outbound._fork import renewed_after_fork
from outbound._log import log_dropping

from .context import Defer, _current, _task_context, narrow_deadline
from .errors import MessageExpired, RateLimited, SendTimeout, TransientSendError
from .messages import (
    ChatId,
    MethodMessage,
    Sender,
    SendRequest,
    SendResult,
    TextMessage,
    _chat_key_of,
)
from .ratelimit import BaseRateLimiter, RateLimiter, RateLimits
from .retry import RetryPolicy, check_number, shown_number

__all__ = [
    "DEFAULT_BUCKETS",
    "HistogramSnapshot",
    "Metrics",
    "MetricsSnapshot",
    "RetryPolicy",
    "SenderDecorator",
    "chain",
    "logging",
    "metrics",
    "rate_limit",
    "retry",
    "timeout",
]

#: Wraps a sender in another one.
SenderDecorator = Callable[[Sender], Sender]

_monotonic = time.monotonic


def chain(*decorators: SenderDecorator) -> SenderDecorator:
    """Compose ``decorators`` into one, the first outermost.

    ``chain(a, b, c)(sender)`` is ``a(b(c(sender)))``. ``chain()`` returns
    the sender unchanged.
    """
    for decorator in decorators:
        if not callable(decorator):
            raise TypeError(f"not a sender decorator: {decorator!r}")

    def apply(sender: Sender) -> Sender:
        for decorator in reversed(decorators):
            sender = decorator(sender)
        return sender

    return apply


class _Wrapper:
    """Base of the middleware senders: holds the inner sender, forwards ``validate``
    and ``chat_key``."""

    __slots__ = ("_inner", "_inner_chat_key", "_inner_validate")

    def __init__(self, inner: Sender) -> None:
        if not callable(getattr(inner, "send", None)):
            raise TypeError(f"not a Sender (no send method): {inner!r}")
        self._inner: Final = inner
        validate = getattr(inner, "validate", None)
        self._inner_validate: Final[Callable[[SendRequest], object] | None] = (
            validate if callable(validate) else None
        )
        self._inner_chat_key: Final = _chat_key_of(inner)

    @property
    def inner(self) -> Sender:
        """The sender this one wraps."""
        return self._inner

    def validate(self, request: SendRequest) -> None:
        """Check ``request`` with the wrapped sender's ``validate``, if it has one."""
        if self._inner_validate is not None:
            self._inner_validate(request)

    def chat_key(self, chat_id: ChatId) -> Hashable:
        """The wrapped sender's ``chat_key(chat_id)``, if it has one; else ``chat_id``."""
        if self._inner_chat_key is not None:
            return self._inner_chat_key(chat_id)
        return chat_id

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {self._inner!r}>"


def _method(request: SendRequest) -> str:
    message = request.message
    return message.method if isinstance(message, MethodMessage) else "text"


# ------------------------------------------------------------------ metrics

#: Default upper bounds (seconds) of the latency histograms' buckets.
DEFAULT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A latency histogram at one instant.

    ``counts[i]`` counts observations ``<= bounds[i]`` (and above the
    previous bound); the last entry, one more than ``bounds``, counts
    those above every bound.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0

    def quantile(self, q: float) -> float:
        """An upper bound of the ``q`` quantile (the bound of its bucket; inf past the last)."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be in [0, 1], not {q!r}")
        if not self.count:
            return 0.0
        rank = q * self.count
        seen = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            seen += n
            if seen >= rank and n:
                return bound
        return math.inf


def _check_buckets(name: str, buckets: Iterable[float]) -> tuple[float, ...]:
    """``buckets`` as floats if they are a non-empty, strictly increasing sequence of
    finite numbers (a repeated bound would make two series of one bucket; a
    last ``inf`` is dropped: the ``+Inf`` bucket is always there), else
    ``TypeError``/``ValueError`` naming ``name``. Pure."""
    given = list(buckets)
    for b in given:
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise TypeError(f"{name} must hold numbers, not {type(b).__name__}")
    if given and given[-1] == math.inf and len(given) > 1:
        given.pop()
    bad = f"{name} must be a non-empty, strictly increasing sequence of finite numbers"
    if any(isinstance(b, int) and b.bit_length() > 1000 for b in given):  # past a float
        raise ValueError(f"{bad}: {shown_number(max(given, key=abs))} is too large")
    bounds = tuple(float(b) for b in given)
    if (
        not bounds
        or not all(math.isfinite(b) for b in bounds)
        or any(b <= a for a, b in itertools.pairwise(bounds))
    ):
        raise ValueError(f"{bad}, not {bounds!r}")
    return bounds


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """Counters of a :func:`metrics` decorator at one instant (taken under its lock).

    Each run of a send through the decorator (``calls``) ends in exactly
    one way, so ``calls == sent + failed_total + deferred_total + in_flight``.

    - ``sent``: runs that returned a result.
    - ``failed``: runs that raised, by error class name (the message's
      final outcome).
    - ``deferred``: runs that raised :class:`~outbound.Defer`, by reason:
      ``"rate_limited"`` (the platform answered 429; retried later),
      ``"retry"`` (a transient error; retried later), ``"throttled"`` (the
      client-side rate limiter said "not yet").
    - ``rate_limited``: 429s the platform answered, retried or not.
    - ``send_seconds``: how long each sent or failed run took.
    - ``total_seconds``: from submit to sent, for each sent message.
    """

    calls: int
    sent: int
    failed: Mapping[str, int]
    deferred: Mapping[str, int]
    rate_limited: int
    in_flight: int
    send_seconds: HistogramSnapshot
    total_seconds: HistogramSnapshot

    @property
    def failed_total(self) -> int:
        return sum(self.failed.values())

    @property
    def deferred_total(self) -> int:
        return sum(self.deferred.values())


class _Histogram:
    """Fixed-bucket histogram; not locked itself, guarded by its owner's lock."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.count, self.sum)


def _defer_reason(defer: Defer) -> str:
    cause = defer.__cause__
    if isinstance(cause, RateLimited):
        return "rate_limited"
    if isinstance(cause, TransientSendError):
        return "retry"
    return "throttled"


class Metrics:
    """The :func:`metrics` decorator: counters and latency histograms of every send.

    Call it on a sender to wrap it (several senders may share one
    ``Metrics``); read :meth:`snapshot`. Thread-safe: one lock guards every
    counter, held for O(1) (O(buckets) in ``snapshot``); never blocks.
    """

    def __init__(self, *, buckets: Iterable[float] = DEFAULT_BUCKETS) -> None:
        bounds = _check_buckets("buckets", buckets)
        # Guards every field below; taken by each sending thread and by snapshot().
        self._lock: Final = renewed_after_fork(threading.Lock())
        self._calls = 0
        self._sent = 0
        self._in_flight = 0
        self._rate_limited = 0
        self._failed: dict[str, int] = {}
        self._deferred: dict[str, int] = {}
        self._send_seconds = _Histogram(bounds)
        self._total_seconds = _Histogram(bounds)

    def __call__(self, sender: Sender) -> Sender:
        return _MetricsSender(sender, self)

    def snapshot(self) -> MetricsSnapshot:
        """A consistent, immutable copy of the counters."""
        with self._lock:
            return MetricsSnapshot(
                calls=self._calls,
                sent=self._sent,
                failed=MappingProxyType(dict(self._failed)),
                deferred=MappingProxyType(dict(self._deferred)),
                rate_limited=self._rate_limited,
                in_flight=self._in_flight,
                send_seconds=self._send_seconds.snapshot(),
                total_seconds=self._total_seconds.snapshot(),
            )

    def _begin(self) -> None:
        with self._lock:
            self._calls += 1
            self._in_flight += 1

    def _end_sent(self, seconds: float, total: float) -> None:
        with self._lock:
            self._in_flight -= 1
            self._sent += 1
            self._send_seconds.observe(seconds)
            self._total_seconds.observe(total)

    def _end_failed(self, error: BaseException, seconds: float) -> None:
        name = type(error).__name__
        with self._lock:
            self._in_flight -= 1
            self._failed[name] = self._failed.get(name, 0) + 1
            if _answered_429(error) is not None:
                self._rate_limited += 1
            self._send_seconds.observe(seconds)

    def _end_deferred(self, defer: Defer) -> None:
        reason = _defer_reason(defer)
        with self._lock:
            self._in_flight -= 1
            self._deferred[reason] = self._deferred.get(reason, 0) + 1
            if reason == "rate_limited":
                self._rate_limited += 1

    def __repr__(self) -> str:
        s = self.snapshot()
        return (
            f"<Metrics calls={s.calls} sent={s.sent} failed={s.failed_total} "
            f"deferred={s.deferred_total} in_flight={s.in_flight}>"
        )


class _MetricsSender(_Wrapper):
    __slots__ = ("_metrics",)

    def __init__(self, inner: Sender, metrics: Metrics) -> None:
        super().__init__(inner)
        self._metrics: Final = metrics

    def send(self, request: SendRequest) -> SendResult:
        metrics = self._metrics
        metrics._begin()
        start = _monotonic()
        try:
            result = self._inner.send(request)
        except Defer as defer:
            metrics._end_deferred(defer)
            raise
        except BaseException as error:
            metrics._end_failed(error, _monotonic() - start)
            raise
        end = _monotonic()
        ctx = _current.context
        metrics._end_sent(end - start, end - (start if ctx is None else ctx.submitted_at))
        return result


def metrics(*, buckets: Iterable[float] = DEFAULT_BUCKETS) -> Metrics:
    """A decorator that counts sends and times them; read it with ``.snapshot()``.

    ``buckets``: upper bounds in seconds of the latency histograms.
    """
    return Metrics(buckets=buckets)


# ------------------------------------------------------------------ logging


def logging(
    *,
    logger: _logging.Logger | str = "outbound.send",
    include_text: bool = False,
) -> SenderDecorator:
    """A decorator that logs each run of a send under ``logger`` (``outbound.send``).

    Sent and deferred runs log at DEBUG, failures at WARNING, with the chat,
    the kind of message, the attempt and the time taken. Message text is
    never logged unless ``include_text=True`` (it is personal data). A
    logging handler or filter that raises changes no outcome: the line is
    dropped.
    """
    log = _logging.getLogger(logger) if isinstance(logger, str) else logger
    if not isinstance(log, _logging.Logger):
        raise TypeError("logger must be a logging.Logger or a logger name")

    def decorate(sender: Sender) -> Sender:
        return _LoggingSender(sender, log, include_text)

    return decorate


class _LoggingSender(_Wrapper):
    __slots__ = ("_include_text", "_log")

    def __init__(self, inner: Sender, log: _logging.Logger, include_text: bool) -> None:
        super().__init__(inner)
        self._log: Final = log
        self._include_text: Final = include_text

    def _describe(self, request: SendRequest) -> str:
        ctx = _current.context
        attempt = "" if ctx is None else f" attempt={ctx.attempt}"
        text = ""
        if self._include_text and isinstance(request.message, TextMessage):
            text = f" text={request.message.text!r}"
        return f"chat={_shown_chat(request.chat_id)} kind={_method(request)}{attempt}{text}"

    def send(self, request: SendRequest) -> SendResult:
        log = self._log
        start = _monotonic()
        try:
            result = self._inner.send(request)
        except Defer as defer:
            if log.isEnabledFor(_logging.DEBUG):
                cause = defer.__cause__
                why = "rate limit" if cause is None else type(cause).__name__
                _quietly(
                    log,
                    _logging.DEBUG,
                    "send deferred %s: %s, again in %.3fs%s",
                    self._describe(request),
                    why,
                    defer.delay,
                    " (all chats paused)" if defer.scope == "all" else "",
                )
            raise
        except BaseException as error:  # (a SystemExit from the sender fails it too)
            if log.isEnabledFor(_logging.WARNING):
                _quietly(
                    log,
                    _logging.WARNING,
                    "send failed %s after %.3fs: %s: %s",
                    self._describe(request),
                    _monotonic() - start,
                    type(error).__name__,
                    error,
                )
            raise
        if log.isEnabledFor(_logging.DEBUG):
            _quietly(
                log,
                _logging.DEBUG,
                "sent %s message_id=%r in %.3fs",
                self._describe(request),
                result.message_id,
                _monotonic() - start,
            )
        return result


def _shown_chat(chat_id: object) -> str:
    """``repr(chat_id)`` for a log line, never raising (an int past 4,300 digits, a
    subclass whose ``__repr__`` fails)."""
    try:
        return shown_number(chat_id)
    except Exception:
        return f"<{type(chat_id).__name__} that cannot be shown>"


def _quietly(log: _logging.Logger, level: int, msg: str, *args: object) -> None:
    """``log.log(level, msg, *args)``, except that a logging handler or filter that
    raises (even ``SystemExit``; not a Ctrl-C in the main thread) changes nothing: a
    message the platform took is sent, and a failure goes up as it was, whatever the
    application's logging does."""
    log_dropping(log, level, msg, args, stacklevel=4)


# -------------------------------------------------------------------- retry


def retry(
    *,
    max_attempts: int = 5,
    base_delay: float = 0.5,
    max_delay: float = 30.0,
    max_total: float = 300.0,
    jitter: float = 0.2,
    rng: Callable[[], float] = random.random,
) -> RetryPolicy:
    """A decorator that sends again after transient failures and 429s, without holding a thread.

    - :class:`~outbound.errors.TransientSendError`: tried again after
      :meth:`RetryPolicy.delay` (exponential backoff with jitter), at most
      ``max_attempts`` tries in all.
    - :class:`~outbound.errors.RateLimited`: tried again after its
      ``retry_after``, but no sooner than ``base_delay`` (see
      :meth:`RetryPolicy.rate_limited_delay`: a 429 saying 0 makes no
      request storm). A 429 does **not** spend an attempt: it is the
      platform saying *when*, not the message failing, and a busy chat
      should not lose messages the platform would take a little later.
      ``max_total`` bounds how long they wait. With scope ``"global"``, the
      rate limiter below (:func:`rate_limit`) holds back every other chat
      of this sender for that long, and no other sender's; without a rate
      limiter below, every lane of the dispatcher is paused instead (a
      warning is logged once when such a chain is built).
    - :class:`~outbound.errors.PermanentSendError` and anything else: raised
      at once.

    Age: a message older than ``max_total`` seconds since its submit fails
    with :class:`~outbound.errors.MessageExpired` instead of going out
    stale, both when a run starts too late and when the next try (after a
    backoff, a ``retry_after``, or the wait the rate limiter asks for)
    would: then at once. Either way it is chained (``__cause__``) to the
    message's last error if there was one, the 429 or transient error of
    this run or of an earlier one. So
    "too stale" is always one type to catch. The wait is a
    :class:`~outbound.Defer`: the dispatcher parks the lane and runs the
    task again later. Outside a dispatcher task nothing can be deferred:
    the send is tried once and its error raised.
    """
    return RetryPolicy(max_attempts, base_delay, max_delay, max_total, jitter, rng)


_FAILURES: Final = "outbound.retry.failures"
_LIMITED: Final = "outbound.retry.rate_limited"
#: The last RateLimited or TransientSendError of the message, for a later
#: MessageExpired's __cause__.
_LAST: Final = "outbound.retry.last_error"

_log = _logging.getLogger("outbound.middleware")
# Guards _warned_unlimited; held for O(1).
_warn_lock: Final = renewed_after_fork(threading.Lock())
_warned_unlimited = False


def _limited_below(sender: Sender) -> bool:
    """True if a :func:`rate_limit` layer is among the senders ``sender`` wraps."""
    current: object = sender
    for _ in range(64):  # a chain is a handful of layers; a cycle must not hang
        if isinstance(current, _RateLimitSender):
            return True
        current = getattr(current, "inner", None)
        if current is None:
            return False
    return False


def _warn_unlimited() -> None:
    global _warned_unlimited
    with _warn_lock:
        if _warned_unlimited:
            return
        _warned_unlimited = True
    _log.warning(
        "outbound: retry() wraps a sender with no rate_limit() below it: a 429 is retried "
        "for its message only, later messages of the chat are not held back, and a bot-wide "
        "429 pauses every lane of the dispatcher. Put rate_limit() between retry() and the "
        "platform sender (this is logged once)"
    )


class _RetrySender(_Wrapper):
    __slots__ = ("_limited", "_policy")

    def __init__(self, inner: Sender, policy: RetryPolicy) -> None:
        super().__init__(inner)
        self._policy: Final = policy
        # With a limiter below, a bot-wide 429 is held there (for this sender's
        # chats only); without one, only a dispatcher-wide pause holds it.
        self._limited: Final = _limited_below(inner)
        if not self._limited:
            _warn_unlimited()

    def send(self, request: SendRequest) -> SendResult:
        ctx = _task_context()
        if ctx is None:
            return self._inner.send(request)
        policy = self._policy
        # Failed sends of this message so far: kept in the task's state,
        # which outlives the Defer re-runs (ctx.attempt counts every run,
        # throttled ones included).
        state = ctx.state
        failures: int = state.get(_FAILURES, 0)
        age = _monotonic() - ctx.submitted_at
        last: BaseException | None = state.get(_LAST)
        if policy.expired(age):
            raise MessageExpired(
                f"not sent: the message is {age:.3f}s old, past max_total={policy.max_total:g}s "
                f"({failures} failed attempts, {state.get(_LIMITED, 0)} 429s)"
            ) from last
        try:
            return self._inner.send(request)
        except Defer as defer:
            # A wait asked for below (the rate limiter): fail now if the message
            # would be too old once it is over.
            if not ctx.cancelled:
                self._check_age(ctx.submitted_at, defer.delay, defer.__cause__, last)
            raise
        except RateLimited as error:
            if ctx.cancelled:
                raise
            state[_LIMITED] = state.get(_LIMITED, 0) + 1
            wait = policy.rate_limited_delay(error.retry_after)
            self._check_age(ctx.submitted_at, wait, error, last)
            state[_LAST] = error
            scope: Literal["lane", "all"] = (
                "all" if error.scope == "global" and not self._limited else "lane"
            )
            raise Defer(wait, scope=scope) from error
        except TransientSendError as error:
            failures += 1
            if policy.gives_up(failures) or ctx.cancelled:
                raise
            delay = policy.delay(failures)
            self._check_age(ctx.submitted_at, delay, error, last)
            state[_FAILURES] = failures
            state[_LAST] = error
            raise Defer(delay) from error

    def _check_age(
        self,
        submitted_at: float,
        delay: float,
        error: BaseException | None,
        last: BaseException | None,
    ) -> None:
        """Raise MessageExpired if a try after ``delay`` would be too late: chained to
        ``error`` (what this run ended on; None for the rate limiter's wait), else to
        ``last`` (the message's last error before this run)."""
        age = _monotonic() + delay - submitted_at
        if self._policy.expired(age):
            why = "the rate limiter" if error is None else f"{type(error).__name__}: {error}"
            expired = MessageExpired(
                f"not sent: a try after {delay:.3f}s more would be {age:.3f}s after the submit, "
                f"past max_total={self._policy.max_total:g}s ({why})"
            )
            expired._ended_on = error
            raise expired from (error if error is not None else last)


def _answered_429(error: BaseException | None) -> RateLimited | None:
    """The platform's 429 a failed run ended on, if any: ``error`` itself, or the one a
    :class:`~outbound.errors.MessageExpired` was raised at in that same run (not an
    earlier run's 429, which that run counted as it was deferred); never the
    client-side limiter's own refusal."""
    if isinstance(error, MessageExpired):
        error = error._ended_on
    if isinstance(error, RateLimited) and error._from_platform:
        return error
    return None


# --------------------------------------------------------------- rate_limit


def rate_limit(limits: RateLimits | BaseRateLimiter) -> SenderDecorator:
    """A decorator that paces sends per ``limits`` and honours the platform's 429s.

    ``limits`` is a :class:`~outbound.ratelimit.RateLimits` (such as
    :data:`~outbound.ratelimit.TELEGRAM`; one
    :class:`~outbound.ratelimit.RateLimiter` is made and shared by every
    sender this decorator wraps) or a ready limiter: a ``RateLimiter`` (to
    share it further, or inject a clock), or a
    :class:`~outbound.ratelimit.RedisRateLimiter` or
    :class:`~outbound.ratelimit.PostgresRateLimiter` (one budget for every
    process of the bot).

    When a send may not go yet, it raises :class:`~outbound.Defer` with the
    time until it may: the lane is parked and other chats use the thread
    meanwhile. Outside a dispatcher task it raises
    :class:`~outbound.errors.RateLimited` instead: ``scope="global"`` under a
    bot-wide ban the limiter knows of, else ``"chat"``. When the platform answers
    429, the ban is recorded in the limiter (that chat, or every chat, waits
    out ``retry_after``) before the error goes on up, whatever the layers
    above then do with that message; a 429 whose scope the platform did not
    state leaves with the scope the limiter inferred. Never blocks.
    """
    if isinstance(limits, BaseRateLimiter):
        limiter = limits
    elif isinstance(limits, RateLimits):
        limiter = RateLimiter(limits)
    else:
        raise TypeError(
            f"limits must be a RateLimits or a rate limiter, not {type(limits).__name__}"
        )

    def decorate(sender: Sender) -> Sender:
        return _RateLimitSender(sender, limiter)

    return decorate


class _RateLimitSender(_Wrapper):
    __slots__ = ("_limiter",)

    def __init__(self, inner: Sender, limiter: BaseRateLimiter) -> None:
        super().__init__(inner)
        self._limiter: Final = limiter

    @property
    def limiter(self) -> BaseRateLimiter:
        return self._limiter

    def send(self, request: SendRequest) -> SendResult:
        limiter = self._limiter
        # (The chat as the platform knows it: Telegram's "@Name" is "@name".)
        chat_id = self.chat_key(request.chat_id)
        if _task_context() is None:
            wait = limiter.acquire(chat_id, book=False)
            if wait > 0.0:
                # Under a bot-wide ban every chat waits: said so, or a caller that
                # turns to other chats meanwhile would only be refused again.
                scope: Literal["chat", "global"] = (
                    "global" if limiter._global_ban_left() > 0.0 else "chat"
                )
                refused = RateLimited(
                    wait, scope, f"client-side rate limit: retry after {wait:.3f}s"
                )
                refused._from_platform = False
                raise refused
        else:
            wait = limiter.acquire(chat_id)
            if wait > 0.0:
                raise Defer(wait)
        try:
            return self._inner.send(request)
        except RateLimited as error:
            scope = limiter.record_429(
                chat_id, error.retry_after, error.scope if error.stated else None
            )
            if scope == error.scope:
                raise
            raise RateLimited(
                error.retry_after, scope, f"{error} (scope inferred: {scope})", stated=False
            ) from error


# ------------------------------------------------------------------ timeout


def timeout(seconds: float | None = None) -> SenderDecorator:
    """A decorator that bounds the platform call by the task's time left (and ``seconds``).

    Inside a dispatcher task, the inner sender sees (through
    :func:`~outbound.current_context`) a deadline of the task's deadline or
    ``seconds`` from now, whichever is sooner, and turns it into its socket
    timeouts. If no time is left, it raises
    :class:`~outbound.errors.SendTimeout` (a transient error) at once,
    without sending.
    Outside a task, with ``seconds`` given, the inner sender sees a context
    with that deadline; without (or ``inf``), the call is passed through.
    """
    if seconds is not None:
        seconds = check_number("seconds", seconds, allow_inf=True, positive=True)
        if seconds == math.inf:
            seconds = None  # no bound of its own, as without

    def decorate(sender: Sender) -> Sender:
        return _TimeoutSender(sender, seconds)

    return decorate


class _TimeoutSender(_Wrapper):
    __slots__ = ("_seconds",)

    def __init__(self, inner: Sender, seconds: float | None) -> None:
        super().__init__(inner)
        self._seconds: Final = seconds

    def send(self, request: SendRequest) -> SendResult:
        ctx = _current.context
        seconds = self._seconds
        now = _monotonic()
        if ctx is None:
            if seconds is None:
                return self._inner.send(request)
        elif ctx.deadline <= now:
            raise SendTimeout("not sent: the task's deadline has already passed")
        elif seconds is None or ctx.deadline <= now + seconds:
            return self._inner.send(request)
        assert seconds is not None
        with narrow_deadline(now + seconds):
            return self._inner.send(request)
