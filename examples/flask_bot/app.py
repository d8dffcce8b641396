"""A small echo bot on Flask and outbound: ``POST /hook`` replies through the dispatcher.

Run it with one command (with no ``OUTBOUND_TELEGRAM_TOKEN`` set, a stand-in
Telegram platform starts on loopback and ``GET /received/<chat_id>`` shows
what it got)::

    python examples/flask_bot/app.py

``python examples/flask_bot/app.py --check`` sends a few updates through the
app and exits 0 if they arrived in order. Under gunicorn, see README.md.

The configuration comes from ``OUTBOUND_*`` environment variables (values
parsed as JSON when they are JSON, else taken as strings). An update it
cannot answer gets a 400 naming the problem; a reply that fails later is a
warning in the log, with its chat.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from concurrent.futures import Future
from typing import Any

from flask import Blueprint, Flask, current_app, jsonify, request
from flask.typing import ResponseReturnValue

from outbound.contrib.flask import CONFIG_DEFAULTS, Outbound, shutdown_all
from outbound.errors import DispatcherClosed, QueueFull
from outbound.messages import SendResult
from outbound.ratelimit import Rate, RateLimits
from outbound.simulator import PlatformSimulator

outbound = Outbound()
bot = Blueprint("bot", __name__)


def create_app(config: dict[str, Any] | None = None) -> Flask:
    """The app factory: config from ``OUTBOUND_*`` environment variables, then ``config``."""
    app = Flask(__name__)
    for key in CONFIG_DEFAULTS:
        if key in os.environ:
            app.config[key] = _parse(os.environ[key])
    app.config.update(config or {})
    outbound.init_app(app)
    app.register_blueprint(bot)
    return app


def _parse(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


#: What the bot puts before the text it echoes.
PREFIX = "echo: "
#: The longest text whose echo fits in one Telegram message (4096 characters).
MAX_TEXT = 4096 - len(PREFIX)
#: Telegram's chat ids fit in 52 bits.
MAX_CHAT_ID = 2**52

_USAGE = 'send {"chat_id": 42, "text": "hello"}, or a Telegram Update with a message'


def _chat_and_text(update: dict[str, Any]) -> tuple[object, object]:
    """``{"chat_id": .., "text": ..}``, or a Telegram Update with a message."""
    message = update.get("message")
    if isinstance(message, dict):
        chat = message.get("chat")
        return (chat.get("id") if isinstance(chat, dict) else None), message.get("text")
    return update.get("chat_id"), update.get("text")


def _problem(update: object) -> str | None:
    """What is wrong with an update, in words for whoever sent it; None if nothing."""
    if not isinstance(update, dict):
        return f"the body must be a JSON object: {_USAGE}"
    chat_id, text = _chat_and_text(update)
    if chat_id is None:
        return f"chat_id is missing: {_USAGE}"
    if isinstance(chat_id, bool) or not isinstance(chat_id, (int, str)):
        return f"chat_id must be a chat's integer id or a public '@channelname', not {chat_id!r}"
    if isinstance(chat_id, int) and not 0 < abs(chat_id) < MAX_CHAT_ID:
        return f"chat_id {chat_id} is not a Telegram chat id (a non-zero integer of 52 bits)"
    if isinstance(chat_id, str) and not (chat_id.startswith("@") and len(chat_id) > 1):
        return f"chat_id must be a chat's integer id or a public '@channelname', not {chat_id!r}"
    if text is None:
        return f"text is missing: {_USAGE}"
    if not isinstance(text, str) or not text.strip():
        return f"text must be a non-empty string, not {text!r}"
    if len(text) > MAX_TEXT:
        return f"text is {len(text)} characters long; an echo fits {MAX_TEXT} at most"
    return None


@bot.post("/hook")
def hook() -> ResponseReturnValue:
    """Answer 200 as soon as the reply is queued; 400 naming what is wrong with the update
    (sending it again would not help); 503 if the reply was refused for now (a full queue:
    the platform sends the update again)."""
    update = request.get_json(silent=True)
    problem = _problem(update)
    if problem is not None:
        return jsonify(ok=False, error=problem), 400
    assert isinstance(update, dict)
    chat_id, text = _chat_and_text(update)
    assert isinstance(chat_id, (int, str))
    future = outbound.reply_text(chat_id, f"{PREFIX}{text}")
    if future.done() and not future.cancelled():
        # Refused before anything was sent. (A reply can also be done by
        # now because it went out, or failed at the platform, already: that
        # one was queued, and its callback below logs a failure.)
        error = future.exception()
        if isinstance(error, (QueueFull, DispatcherClosed)):
            current_app.logger.warning("reply to chat %r refused: %s", chat_id, _describe(error))
            return jsonify(ok=False, error=_describe(error)), 503
        if isinstance(error, (TypeError, ValueError)):  # a rule of the platform's
            return jsonify(ok=False, error=str(error)), 400
    future.add_done_callback(outbound.with_app_context(functools.partial(_log_failure, chat_id)))
    return jsonify(ok=True, pid=os.getpid())


def _describe(error: BaseException | None) -> str:
    return f"{type(error).__name__}: {error}" if error is not None else "no error"


def _log_failure(chat_id: int | str, future: Future[SendResult]) -> None:
    """A reply that did not go out, in the log: runs in a worker thread, under the app's
    context (or in the thread that stopped the bot)."""
    if future.cancelled():
        current_app.logger.warning(
            "reply to chat %r not sent: the bot stopped before it went out", chat_id
        )
    elif (error := future.exception()) is not None:
        current_app.logger.warning("reply to chat %r failed: %s", chat_id, _describe(error))


@bot.get("/health")
def health() -> ResponseReturnValue:
    return jsonify(ok=True, pid=os.getpid(), started=outbound.started())


def _add_received_route(app: Flask, platform: PlatformSimulator) -> None:
    @app.get("/received/<chat_id>")
    def received(chat_id: str) -> ResponseReturnValue:
        return jsonify([m["text"] for m in platform.received(chat_id)])


def _check(app: Flask, platform: PlatformSimulator) -> int:
    """Send 3 updates to each of 3 chats through the app; 0 if all arrived in order."""
    client = app.test_client()
    chats = [101, 102, 103]
    for n in range(3):
        for chat in chats:
            response = client.post("/hook", json={"chat_id": chat, "text": f"hello {n}"})
            if response.status_code != 200:
                print(f"POST /hook answered {response.status_code}: {response.get_json()}")
                return 1
    if not platform.wait_received(len(chats) * 3, timeout=10.0):
        print("not everything arrived within 10 s")
        return 1
    ok = True
    for chat in chats:
        texts = [m["text"] for m in platform.received(chat)]
        print(f"chat {chat}: {texts}")
        ok = ok and texts == [f"echo: hello {n}" for n in range(3)]
    print("in order: yes" if ok else "in order: NO")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--check", action="store_true", help="send a few updates, then exit")
    args = parser.parse_args(argv)
    # Before the app exists, so that Flask adds no handler of its own: the
    # app's warnings (a reply that failed) and the library's go to stderr.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")

    platform: PlatformSimulator | None = None
    config: dict[str, Any] = {}
    if "OUTBOUND_TELEGRAM_TOKEN" not in os.environ:
        platform = PlatformSimulator(chat_rate=5.0, global_rate=30.0, latency=0.02).start()
        config = {
            "OUTBOUND_TELEGRAM_TOKEN": platform.token,
            "OUTBOUND_TELEGRAM_URL": platform.url,
            "OUTBOUND_RATE_LIMITS": RateLimits(overall=Rate(30), per_chat=Rate(5)),
        }
    try:
        app = create_app(config)
        if platform is not None:
            _add_received_route(app, platform)
        if args.check:
            if platform is None:
                print("--check needs the stand-in platform: unset OUTBOUND_TELEGRAM_TOKEN")
                return 2
            return _check(app, platform)
        base = f"http://{args.host}:{args.port}"
        print(f"bot at {base}; try:")
        print(
            f"  curl -s {base}/hook -H 'Content-Type: application/json' "
            """-d '{"chat_id": 42, "text": "hello"}'"""
        )
        if platform is not None:
            print(f"  curl -s {base}/received/42     # what the stand-in platform got")
        app.run(host=args.host, port=args.port, threaded=True)
        return 0
    finally:
        shutdown_all(timeout=10.0)
        if platform is not None:
            platform.stop()


if __name__ == "__main__":
    sys.exit(main())
