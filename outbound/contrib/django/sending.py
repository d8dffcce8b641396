"""``reply`` and ``reply_text`` for Django: a lazily built :class:`~outbound.Outbound` per process.

Nothing is built at import or in ``AppConfig.ready()``: the first
:func:`reply` (or :func:`get_outbound`) builds the sender and the
:class:`~outbound.Dispatcher` from ``settings.OUTBOUND``, and the
dispatcher starts its first thread on the first send. The dispatcher is
fork-safe (a forked worker of a pre-fork server gets an empty one of its
own) and gets a bounded shutdown at interpreter exit (``exit_timeout``).
When the ``OUTBOUND`` setting changes (``override_settings``), the old
one is shut down and the next call builds a new one.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.utils.module_loading import import_string

from outbound import middleware, ratelimit
from outbound.dispatcher import Dispatcher
from outbound.messages import ChatId, Message, Sender, SendResult
from outbound.reply import Outbound
from outbound.telegram import TelegramSender

from .conf import Settings, get_settings

__all__ = ["get_outbound", "reply", "reply_text", "shutdown"]

# Seconds a settings change waits for the old dispatcher's sends.
_RESET_TIMEOUT = 10.0
_PRESETS = {"telegram": ratelimit.TELEGRAM, "slack": ratelimit.SLACK}

# Guards _outbound. Held while one is built (quick: building starts no
# thread and does no I/O); callers of get_outbound() and shutdown() wait on it.
_lock = threading.Lock()
_outbound: Outbound | None = None


def build_sender(conf: Settings) -> Sender:
    """The platform sender of ``conf``, wrapped in retry → rate limit → timeout.

    Raises ``ImproperlyConfigured`` when neither ``sender`` nor a Telegram
    token is set, or the sender factory cannot be imported, raises, or does
    not return a sender.
    """
    platform: Any
    if conf.sender is not None:
        try:
            platform = import_string(conf.sender)()
        except Exception as exc:  # (ImportError too: the setting names no factory)
            raise ImproperlyConfigured(
                f"OUTBOUND['sender'] {conf.sender!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if not callable(getattr(platform, "send", None)):
            raise ImproperlyConfigured(
                f"OUTBOUND['sender'] {conf.sender!r} returned {platform!r}, not a Sender"
            )
    elif conf.telegram_token is not None:
        platform = TelegramSender(conf.telegram_token, base_url=conf.telegram_base_url)
    else:
        raise ImproperlyConfigured(
            "outbound cannot send: set OUTBOUND['telegram']['token'] or OUTBOUND['sender']"
        )
    layers: list[middleware.SenderDecorator] = [middleware.retry(max_attempts=conf.retry_attempts)]
    if conf.rate_limits is not None:
        layers.append(middleware.rate_limit(_PRESETS[conf.rate_limits]))
    layers.append(middleware.timeout())
    sender: Sender = middleware.chain(*layers)(platform)
    return sender


def get_outbound() -> Outbound:
    """This process's :class:`~outbound.Outbound`, built on first use from ``settings.OUTBOUND``.

    Thread-safe; blocks only while another thread builds it. Raises
    ``ImproperlyConfigured`` when the settings are invalid or name no sender.
    """
    global _outbound
    outbound = _outbound
    if outbound is not None:
        return outbound
    with _lock:
        if _outbound is None:
            conf = get_settings()
            sender = build_sender(conf)  # (first: a dispatcher for no sender is never made)
            dispatcher = Dispatcher(
                max_inflight=conf.max_inflight,
                queue_size=conf.queue_size,
                send_timeout=conf.send_timeout,
                exit_timeout=conf.exit_timeout,
                thread_name_prefix="outbound-django",
            )
            _outbound = Outbound(dispatcher, sender)
        return _outbound


def reply(
    chat_id: ChatId, message: Message, *, idempotency_key: str | None = None
) -> Future[SendResult]:
    """Queue ``message`` for ``chat_id``; return the future of its result (see :class:`Outbound`).

    Never blocks. Raises ``ImproperlyConfigured`` if ``OUTBOUND`` cannot
    build a sender; every other refusal comes back inside the future.
    """
    return get_outbound().reply(chat_id, message, idempotency_key=idempotency_key)


def reply_text(
    chat_id: ChatId,
    text: str,
    *,
    parse_mode: str | None = None,
    disable_notification: bool = False,
    idempotency_key: str | None = None,
) -> Future[SendResult]:
    """:func:`reply` with a text message. Never blocks; raises only ``ImproperlyConfigured``."""
    return get_outbound().reply_text(
        chat_id,
        text,
        parse_mode=parse_mode,
        disable_notification=disable_notification,
        idempotency_key=idempotency_key,
    )


def built_dispatcher() -> Dispatcher | None:
    """The dispatcher of the Outbound built in this process, if one was (nothing is
    built here): the worker command waits for its replies. Thread-safe."""
    outbound = _outbound
    return outbound.dispatcher if outbound is not None else None


def shutdown(timeout: float | None = None) -> bool:
    """Shut the built Outbound down (close, wait up to ``timeout`` for its sends) and forget it.

    The next :func:`reply` builds a new one. Returns True if every accepted
    send finished in time (or none was built). Thread-safe; blocks up to
    ``timeout`` (``None``: until done).
    """
    global _outbound
    with _lock:
        outbound, _outbound = _outbound, None
    if outbound is None:
        return True
    done = outbound.dispatcher.shutdown(timeout)
    _close_sender(outbound.sender)
    return done


def _close_sender(sender: object) -> None:
    while sender is not None:
        close = getattr(sender, "close", None)
        if callable(close):
            close()
            return
        sender = getattr(sender, "inner", None)


def _reset(*, setting: str, **kwargs: Any) -> None:
    if setting == "OUTBOUND":
        shutdown(_RESET_TIMEOUT)


def _after_fork_in_child() -> None:
    """Another thread may have held the lock at the fork; the dispatcher rebuilds itself."""
    global _lock
    _lock = threading.Lock()


setting_changed.connect(_reset, dispatch_uid="outbound.contrib.django.sending")
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
