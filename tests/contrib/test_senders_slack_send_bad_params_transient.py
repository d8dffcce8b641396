"""SlackSender.send() refuses parameters that are not JSON with TypeError, nothing
sent: bad input, never a TransientSendError that retry() would try again (outbox
handlers call send() without validate())."""

from __future__ import annotations

import pytest
from canned_senders import SLACK_OK, canned, slack_sender

from outbound.messages import MethodMessage, SendRequest


def test_slack_send_refuses_parameters_that_are_not_json() -> None:
    with canned() as server:
        server.answer(200, SLACK_OK)
        request = SendRequest(
            "C01", MethodMessage("chat.postMessage", {"text": "hi", "tags": {"a"}})
        )
        with pytest.raises(TypeError):
            slack_sender(server.url).send(request)
        assert server.posts == 0
