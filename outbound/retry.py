"""One retry policy for every layer: the sender middleware and the outbox relay.

:class:`RetryPolicy` answers two questions and nothing else: how long to
wait after the ``n``-th failure (exponential backoff, capped, with
jitter taken off), and whether one more try is allowed (``max_attempts``
failures, and an age bound ``max_total`` measured from when the work was
accepted). Who waits, and how, belongs to the caller: the middleware
raises :class:`~outbound.Defer`, the relay writes the row back with a
``run_after``.

Immutable and thread-safe; the random source is injectable so that tests
and simulations are reproducible.
"""

from __future__ import annotations

import email.utils
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timezone
from typing import TYPE_CHECKING, ClassVar

from .errors import RateLimited

if TYPE_CHECKING:
    from .messages import Sender

__all__ = ["RetryPolicy", "parse_retry_after"]


def shown_number(value: object) -> str:
    """``repr(value)`` for an error message, or the size of an int too long for one
    (``repr`` raises past 4,300 digits, and a float holds none past 1,024 bits). Pure."""
    if isinstance(value, int) and value.bit_length() > 1000:
        return f"an int of {value.bit_length()} bits"
    return repr(value)


def check_number(
    name: str, value: object, *, allow_inf: bool = False, positive: bool = False
) -> float:
    """``value`` as a float if it is a number >= 0 (> 0 with ``positive``; finite
    unless ``allow_inf``, when an int too large for a float is ``inf``), else
    ``TypeError``/``ValueError`` naming ``name``.

    The one check of a delay, a timeout or a bound in seconds, shared by the
    sending layer.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, not {type(value).__name__}")
    bound = f"{'' if allow_inf else 'finite '}number {'>' if positive else '>='} 0"
    if isinstance(value, int) and value.bit_length() > 1000:  # past a float
        if value > 0 and allow_inf:
            return math.inf
        raise ValueError(f"{name} must be a {bound}, not {shown_number(value)}")
    if not ((value > 0 if positive else value >= 0) and (allow_inf or math.isfinite(value))):
        raise ValueError(f"{name} must be a {bound}, not {value!r}")
    return float(value)


def parse_retry_after(value: object, *, clock: Callable[[], float] = time.time) -> float | None:
    """Seconds a ``Retry-After`` value asks to wait, or None if it is not one.

    ``value`` is a number of seconds (an ``int``, a ``float`` or a decimal
    numeral ``str`` such as ``"30"`` or ``"1.5e3"``, >= 0) or an HTTP date
    (RFC 9110, such as ``"Wed, 21 Oct 2015 07:28:00 GMT"``), which counts
    from ``clock()`` (wall-clock seconds since the epoch) and is 0.0 once
    past. A header sent twice and joined with a comma, as proxies and client
    libraries join a repeated field (``"30, 30"``), reads as its first value.
    The result is cut to
    :attr:`RateLimited.MAX_RETRY_AFTER <outbound.errors.RateLimited.MAX_RETRY_AFTER>`
    (one day), also for a number too large for a float (``1e400`` in JSON
    reads as infinity). NaN, negative values and words (``"inf"``) are not
    one. For sender authors; never blocks.
    """
    if isinstance(value, bool):
        return None
    seconds: float | None = None
    if isinstance(value, int) and value.bit_length() > 1000:
        # Past what a float holds: past a day, or negative.
        seconds = RateLimited.MAX_RETRY_AFTER if value > 0 else None
    elif isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, (str, bytes)):
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        seconds = _seconds_of(text, clock)
        if seconds is None and "," in text:
            # Joined: the first value ("30, 30"), or the first date (a date
            # has a comma of its own: "Wed, 21 Oct 2015 07:28:00 GMT").
            parts = text.split(",", 2)
            seconds = _seconds_of(parts[0], clock)
            if seconds is None:
                seconds = _seconds_of(",".join(parts[:2]), clock)
    if seconds is None or not seconds >= 0.0:  # NaN fails too
        return None
    return min(seconds, RateLimited.MAX_RETRY_AFTER)


def _seconds_of(text: str, clock: Callable[[], float]) -> float | None:
    """The seconds of one ``Retry-After`` value as text (a numeral, or an HTTP date
    counted from ``clock()``), or None if it is neither."""
    text = text.strip()
    if _NUMERAL.fullmatch(text):
        return float(text)  # never raises; too large: inf
    try:
        when = email.utils.parsedate_to_datetime(text)
        if when.tzinfo is None:  # RFC 9110 dates are in GMT
            when = when.replace(tzinfo=timezone.utc)
        stamp = when.timestamp()
    except (TypeError, ValueError, IndexError, OverflowError):  # (a year past 9999)
        return None
    return max(0.0, stamp - clock())


#: A number of seconds as text: digits, a fraction, an exponent (no words such
#: as "inf" or "nan", no "_" separators, which float() takes).
_NUMERAL = re.compile(r"\+?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)


@dataclass(frozen=True)
class RetryPolicy:
    """When to try again after a failure. Immutable; thread-safe.

    - ``max_attempts``: tries in all (the first one included); after that
      many failures the work fails for good. A 429 is not a failure: the
      platform said when to come back, so waiting for it spends no attempt
      (in the middleware and in the outbox relay alike); ``max_total``
      bounds those waits. The wait after a 429 is its ``retry_after``, but
      at least ``base_delay`` (and at least :attr:`MIN_RATE_LIMITED_DELAY`;
      see :meth:`rate_limited_delay`): a server answering 429 with
      ``retry_after`` 0 (or a ``Retry-After`` date already past) would
      otherwise be asked again at once, thousands of times a second, for
      as long as ``max_total`` allows.
    - ``base_delay``, ``max_delay``: the backoff after the ``n``-th failure
      is ``min(max_delay, base_delay * 2 ** (n - 1))`` seconds ...
    - ``jitter``: ... of which a random fraction up to ``jitter`` is taken
      off (0: exact; 1: "full jitter"). Jitter never lengthens a wait, so
      ``max_delay`` is a true bound.
    - ``max_total``: the age bound in seconds, from when the work was
      accepted (a message's submit, an outbox row's enqueue). A retry that
      would start past it is not made; ``math.inf`` means no bound.
    - ``rng``: returns a float in ``[0, 1)``; :func:`random.random` by
      default.

    Used as a sender decorator (``policy(sender)``, what
    :func:`outbound.middleware.retry` returns) and as the outbox relay's
    ``retry`` option.
    """

    #: The shortest wait after a 429, whatever its ``retry_after`` and ``base_delay``.
    MIN_RATE_LIMITED_DELAY: ClassVar[float] = 0.05

    max_attempts: int = 5
    base_delay: float = 0.5
    max_delay: float = 30.0
    max_total: float = 300.0
    jitter: float = 0.2
    rng: Callable[[], float] = field(default=random.random, compare=False, repr=False)

    def __post_init__(self) -> None:
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int):
            raise TypeError(f"max_attempts must be an int, not {type(attempts).__name__}")
        if attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, not {attempts!r}")
        # Kept as the floats checked (an int too large to print is inf).
        set_ = object.__setattr__
        set_(self, "base_delay", check_number("base_delay", self.base_delay))
        set_(self, "max_delay", check_number("max_delay", self.max_delay))
        if self.max_delay < self.base_delay:
            raise ValueError(
                f"max_delay ({self.max_delay!r}) must be >= base_delay ({self.base_delay!r})"
            )
        set_(self, "max_total", check_number("max_total", self.max_total, allow_inf=True))
        if self.max_total == 0:
            raise ValueError("max_total must be > 0")
        set_(self, "jitter", check_number("jitter", self.jitter))
        if self.jitter > 1.0:
            raise ValueError(f"jitter must be in [0, 1], not {self.jitter!r}")
        if not callable(self.rng):
            raise TypeError(f"rng must be callable, not {type(self.rng).__name__}")

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure (``failures >= 1``)."""
        exponent = min(max(failures, 1) - 1, 64)
        delay = min(self.max_delay, self.base_delay * 2.0**exponent)
        if self.jitter:
            fraction = self.rng()
            if not 0.0 <= fraction <= 1.0:  # a bad source must not stretch or negate the wait
                fraction = 0.0 if math.isnan(fraction) else min(max(fraction, 0.0), 1.0)
            delay *= 1.0 - self.jitter * fraction
        return delay

    def rate_limited_delay(self, retry_after: float) -> float:
        """Seconds to wait after a 429 that asked for ``retry_after``: that, but at
        least ``base_delay`` (0.5 s by default) and at least
        :attr:`MIN_RATE_LIMITED_DELAY` (0.05 s, with a ``base_delay`` of 0), so
        that a server answering each try with a 429 of ``retry_after`` 0 is
        asked again after a pause (twice a second by default), not in a tight
        loop. Real platforms ask for whole seconds, which this leaves as they
        are. A wait that is not a number >= 0 (NaN) is the floor too. Pure."""
        floor = max(self.base_delay, self.MIN_RATE_LIMITED_DELAY)
        return retry_after if retry_after >= floor else floor

    def gives_up(self, failures: int) -> bool:
        """True when ``failures`` failed tries leave no attempt."""
        return failures >= self.max_attempts

    def expired(self, age: float) -> bool:
        """True when work accepted ``age`` seconds ago is past ``max_total``."""
        return age > self.max_total

    def __call__(self, sender: Sender) -> Sender:
        """Wrap ``sender`` so that it retries by this policy (:func:`outbound.middleware.retry`)."""
        from .middleware import _RetrySender  # noqa: PLC0415  (the sending layer imports this module)

        return _RetrySender(sender, self)
