"""The one retry policy shared by the sender middleware and the outbox relay."""

from __future__ import annotations

import math

import pytest

from outbound import middleware, outbox
from outbound.errors import RateLimited
from outbound.retry import RetryPolicy, parse_retry_after


def test_one_class_for_every_layer() -> None:
    assert middleware.RetryPolicy is RetryPolicy
    assert outbox.RetryPolicy is RetryPolicy
    assert isinstance(middleware.retry(), RetryPolicy)


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = RetryPolicy(base_delay=0.5, max_delay=3.0, jitter=0.0)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.delay(10**9) == 3.0  # no overflow far past the cap
    assert policy.delay(0) == 0.5  # the first failure is the smallest wait


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.999999])
def test_jitter_only_shortens(fraction: float) -> None:
    policy = RetryPolicy(base_delay=2.0, max_delay=2.0, jitter=0.5, rng=lambda: fraction)
    assert policy.delay(1) == pytest.approx(2.0 * (1 - 0.5 * fraction))


@pytest.mark.parametrize("bad", [-1.0, 7.0, math.nan, math.inf, -math.inf])
def test_a_bad_random_source_cannot_stretch_or_negate_a_wait(bad: float) -> None:
    policy = RetryPolicy(base_delay=2.0, max_delay=2.0, jitter=1.0, rng=lambda: bad)
    assert 0.0 <= policy.delay(1) <= 2.0


def test_attempts_and_age_bounds() -> None:
    policy = RetryPolicy(max_attempts=3, max_total=10.0)
    assert not policy.gives_up(2)
    assert policy.gives_up(3)
    assert not policy.expired(10.0)
    assert policy.expired(10.000001)
    assert not RetryPolicy(max_total=math.inf).expired(1e300)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"max_attempts": 0}, ValueError),
        ({"max_attempts": 1.5}, TypeError),
        ({"max_attempts": True}, TypeError),
        ({"base_delay": -1}, ValueError),
        ({"base_delay": math.inf}, ValueError),
        ({"base_delay": "1"}, TypeError),
        ({"max_delay": math.nan}, ValueError),
        ({"base_delay": 2.0, "max_delay": 1.0}, ValueError),
        ({"max_total": 0}, ValueError),
        ({"max_total": -1}, ValueError),
        ({"max_total": math.nan}, ValueError),
        ({"jitter": 1.5}, ValueError),
        ({"jitter": -0.1}, ValueError),
        ({"rng": 3}, TypeError),
    ],
)
def test_bad_settings_are_refused_at_construction(
    options: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        RetryPolicy(**options)  # type: ignore[arg-type]


def test_a_retry_after_too_large_for_a_float_is_cut_to_a_day() -> None:
    # Valid JSON (an integer of 400 digits): float() of it raises OverflowError.
    assert parse_retry_after(10**400) == RateLimited.MAX_RETRY_AFTER
    assert parse_retry_after(int("9" * 400)) == RateLimited.MAX_RETRY_AFTER
    assert parse_retry_after(-(10**400)) is None
    assert parse_retry_after(2**1000) == RateLimited.MAX_RETRY_AFTER
    assert parse_retry_after(30) == 30.0
    # As text (a header), or as a float of JSON (1e400 reads as infinity).
    for huge in ("9" * 400, "1e400", b"1e400", math.inf, float("1e400")):
        assert parse_retry_after(huge) == RateLimited.MAX_RETRY_AFTER, huge
    # And a RateLimited built with one (a sender's own code may).
    assert RateLimited(10**400).retry_after == RateLimited.MAX_RETRY_AFTER
    assert RateLimited(2**1000, "global").retry_after == RateLimited.MAX_RETRY_AFTER
    assert RateLimited(30).retry_after == 30.0


@pytest.mark.parametrize(
    "value", ["inf", "Infinity", "nan", "-1", "-inf", "1_0", "0x10", "", "1e", math.nan, -math.inf]
)
def test_words_signs_and_nan_are_not_a_retry_after(value: object) -> None:
    assert parse_retry_after(value) is None
