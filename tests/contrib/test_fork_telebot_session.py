"""TeleBotSender: a child forked after the parent sent shares the parent's keep-alive
connection (pyTelegramBotAPI keeps one requests session per thread, and the forking
thread's session, with its open socket, is copied into the child).

README "Pre-fork servers": "The locks of the sending chain (rate limiters, metrics,
senders) are made new in the child too ... So gunicorn --preload is safe and
post_fork needs nothing". TelegramSender drops a connection made in another process
(telegram.py, _connection: ``slot.pid != os.getpid()``); TeleBotSender does not, so
a parent and a child that both send outside a dispatcher task (the sync worker's
request thread is the forking thread's copy) write on one TCP connection and read
each other's answers.

The loopback server below answers the child's request only together with the next
request on the same connection (both answers in one write) when, and only when,
the child's request came on the parent's connection: the process that reads first
takes both answers, the other waits out its timeout. With a connection per
process every answer goes to its sender at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("telebot")
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

SCRIPT = textwrap.dedent(
    r"""
    import json, os, select, socket, sys, threading
    from urllib.parse import parse_qs, urlsplit
    import telebot
    from telebot import apihelper
    from outbound.contrib.telebot import TeleBotSender
    from outbound.messages import SendRequest, TextMessage

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    first_conn = []          # the connection that carried the parent's first send
    arrived = {}             # chat id -> threading.Event
    for chat in (1, 2, 3):
        arrived[chat] = threading.Event()
    seen = []                # (connection number, chat id)

    def answer(chat):
        body = json.dumps({"ok": True, "result": {
            "message_id": chat * 10, "date": 0,
            "chat": {"id": chat, "type": "private"}, "text": "x"}}).encode()
        return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Connection: keep-alive\r\nContent-Length: %d\r\n\r\n" % len(body)) + body

    def serve(sock, number):
        sock.settimeout(20)
        f = sock.makefile("rb")
        held = b""
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                target = line.split()[1].decode()
                headers = {}
                while True:
                    h = f.readline()
                    if h in (b"\r\n", b"\n", b""):
                        break
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                n = int(headers.get("content-length", "0"))
                body = f.read(n).decode() if n else ""
                params = {**parse_qs(urlsplit(target).query), **parse_qs(body)}
                chat = int(params["chat_id"][0])
                seen.append((number, chat))
                if chat == 1:
                    first_conn.append(number)
                arrived[chat].set()
                if chat == 2 and first_conn and number == first_conn[0]:
                    held = answer(chat)   # answered with the next request on this connection
                    continue
                sock.sendall(held + answer(chat))
                held = b""
        except OSError:
            return

    def accept():
        number = 0
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            number += 1
            threading.Thread(target=serve, args=(sock, number), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    apihelper.API_URL = f"http://127.0.0.1:{port}/bot{{0}}/{{1}}"
    bot = telebot.TeleBot("123456:ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghi", threaded=False)
    sender = TeleBotSender(bot, timeout=3.0)

    def send(chat):
        try:
            return sender.send(SendRequest(chat, TextMessage("hi"))).message_id
        except Exception as exc:
            return repr(exc)[:200]

    parent_first = send(1)   # a preloaded app's startup message, sent by the master

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.write(w, json.dumps(send(2)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    parent_second = None
    if arrived[2].wait(15):
        parent_second = send(3)
    ready, _, _ = select.select([r], [], [], 20)
    child = json.loads(os.read(r, 4096) or b"null") if ready else "no answer from the child"
    os.waitpid(pid, 0)
    print(json.dumps({"parent_first": parent_first, "child": child,
                      "parent_second": parent_second, "seen": seen, "first_conn": first_conn}))
    """
)


def test_a_child_does_not_send_on_the_parents_telebot_connection() -> None:
    env = dict(os.environ)
    proc = subprocess.run(  # noqa: PLW1510 - the exit code is checked below
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=90, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["parent_first"] == 10, out
    shared = [n for n, chat in out["seen"] if chat == 2] == out["first_conn"]
    assert not shared, (
        "the child's request went out on the parent's keep-alive connection "
        f"(requests seen as (connection, chat): {out['seen']}); answers: {out}"
    )
    # Each process gets the answer to its own request.
    assert out["child"] == 20, out
    assert out["parent_second"] == 30, out
