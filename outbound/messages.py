"""What is sent: messages, requests, results, and the :class:`Sender` protocol.

A :class:`Sender` sends one :class:`SendRequest` and returns a
:class:`SendResult`, or raises one of the send errors of
:mod:`outbound.errors` (:class:`~outbound.errors.RateLimited`,
:class:`~outbound.errors.TransientSendError`,
:class:`~outbound.errors.PermanentSendError`). A sender runs inside a
dispatcher task, so its deadline is ``outbound.current_context().deadline``.

All the data classes here are immutable and safe to share between threads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ChatId",
    "Message",
    "MethodMessage",
    "SendRequest",
    "SendResult",
    "Sender",
    "TextMessage",
    "check_json_params",
    "check_text",
]

#: A chat's id: an int (Telegram; negative for groups) or a str (Slack channel, ``@name``).
ChatId = int | str


@dataclass(frozen=True, slots=True)
class TextMessage:
    """A plain text message. ``text`` must be a non-empty ``str``.

    Platform limits (Telegram: 4096 characters) are checked by the sender's
    ``validate`` before anything is queued.
    """

    text: str
    parse_mode: str | None = None
    disable_notification: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"TextMessage.text must be a str, not {type(self.text).__name__}")
        if not self.text.strip():
            raise ValueError("TextMessage.text must not be empty")
        if self.parse_mode is not None and not isinstance(self.parse_mode, str):
            raise TypeError(
                "TextMessage.parse_mode must be a str or None, "
                f"not {type(self.parse_mode).__name__}"
            )
        if not isinstance(self.disable_notification, bool):
            raise TypeError(
                "TextMessage.disable_notification must be a bool, "
                f"not {type(self.disable_notification).__name__}"
            )


@dataclass(frozen=True, slots=True)
class MethodMessage:
    """Any other platform call: a method name and its parameters.

    For example ``MethodMessage("sendPhoto", {"photo": file_id})`` for
    Telegram or ``MethodMessage("chat.postMessage", {"blocks": [...]})`` for
    Slack. The sender adds the target chat. ``params`` is copied when the
    message is made, with the mappings, lists and tuples in it at any depth,
    as read-only dicts and lists (as JSON has them; changing one raises
    ``TypeError``): changing the caller's dict afterwards (one reused for
    each recipient, say) changes nothing that is sent, and a message
    accepted is sent as it was checked. Hashable when every value is.
    """

    method: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.method, str) or not self.method:
            raise ValueError("MethodMessage.method must be a non-empty str")
        if not isinstance(self.params, Mapping):
            raise TypeError("MethodMessage.params must be a mapping")
        object.__setattr__(self, "params", _copied(self.params))


Message = TextMessage | MethodMessage


@dataclass(frozen=True, slots=True)
class SendRequest:
    """One message to one chat. ``idempotency_key`` lets a platform or a
    handler recognise a retry of the same message."""

    chat_id: ChatId
    message: Message
    idempotency_key: str | None = None

    def __post_init__(self) -> None:
        if self.idempotency_key is not None and not isinstance(self.idempotency_key, str):
            raise TypeError(
                f"idempotency_key must be a str or None, not {type(self.idempotency_key).__name__}"
            )
        if isinstance(self.chat_id, bool) or not isinstance(self.chat_id, (int, str)):
            raise TypeError(f"chat_id must be an int or a str, not {type(self.chat_id).__name__}")
        if isinstance(self.chat_id, str) and not self.chat_id:
            raise ValueError("chat_id must not be empty")
        if not isinstance(self.message, (TextMessage, MethodMessage)):
            raise TypeError(
                "message must be a TextMessage or a MethodMessage, "
                f"not {type(self.message).__name__}"
            )


@dataclass(frozen=True, slots=True)
class SendResult:
    """What the platform answered: the new message's id and the raw response."""

    message_id: int | str | None
    raw: Mapping[str, Any] | None = None


@runtime_checkable
class Sender(Protocol):
    """Sends one message. Must be thread-safe: many workers call it at once.

    ``send`` blocks for the I/O, bounded by the running task's deadline
    (``outbound.current_context().remaining()``), and returns a
    :class:`SendResult` or raises a send error.

    A sender may also offer ``validate(request)`` (raise ``TypeError`` or
    ``ValueError`` for a request the platform would refuse; never blocks)
    and ``chat_key(chat_id)``: the chat as the platform knows it, where two
    ids can name one chat (Telegram's usernames are case-blind: ``"@Name"``
    and ``"@name"`` are one chat). An :class:`~outbound.Outbound` keys a
    chat's lane by it, and the ``rate_limit`` middleware its limits and
    bans; it is pure and never blocks.
    """

    def send(self, request: SendRequest) -> SendResult: ...


def _chat_key_of(sender: object) -> Callable[[ChatId], Hashable] | None:
    """``sender``'s ``chat_key`` method (see :class:`Sender`), or None if it has none."""
    chat_key = getattr(sender, "chat_key", None)
    return chat_key if callable(chat_key) else None


def check_text(text: object, max_length: int) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``text`` is a non-empty str of at most
    ``max_length`` characters, valid Unicode (no lone surrogate, which no platform
    can store): the check every platform sender's ``validate`` makes."""
    if not isinstance(text, str):
        raise TypeError(f"the text must be a str, not {type(text).__name__}")
    if not text.strip():
        raise ValueError("the text must not be empty")
    if len(text) > max_length:
        raise ValueError(f"the text is {len(text)} characters long, over the limit of {max_length}")
    _check_unicode("the text", text)


def check_json_params(message: MethodMessage) -> None:
    """Raise ``TypeError`` unless the parameters of ``message`` encode as JSON, and
    as JSON that keeps every value: no NaN or infinity (not JSON), no object key
    that is not a str (``{1: "a", "1": "b"}`` would arrive as one key), no cycle,
    no nesting past what ``json`` can encode; ``ValueError`` if a string in them
    holds a lone surrogate."""
    try:
        text = json.dumps(dict(message.params), ensure_ascii=False, allow_nan=False)
    except RecursionError:
        raise TypeError(
            f"the parameters of {message.method} are nested too deeply to encode as JSON"
        ) from None
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the parameters of {message.method} are not JSON: {exc}") from exc
    if "{" in text:
        _check_object_keys(message.params, f"the parameters of {message.method}")
    _check_unicode(f"the parameters of {message.method}", text)


def _check_object_keys(value: object, name: str) -> None:
    """``TypeError`` naming the path (from ``name``) of a dict key that is not a str.

    ``json`` turns int, float, bool and None keys into strings, so that
    ``{1: "a", "1": "b"}`` would arrive as ``{"1": "b"}``: a value lost.
    Call it only on a value ``json`` has encoded (no cycle; bounded depth).
    """
    stack: list[tuple[object, str]] = [(value, name)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, Mapping):
            for key, inner in item.items():
                if not isinstance(key, str):
                    raise TypeError(
                        f"{path} has a key of type {type(key).__name__}: object keys "
                        "must be str (JSON would turn it into a string)"
                    )
                if isinstance(inner, (Mapping, list, tuple)):
                    stack.append((inner, f"{path}[{key[:40]!r}]"))
        elif isinstance(item, (list, tuple)):
            for index, inner in enumerate(item):
                if isinstance(inner, (Mapping, list, tuple)):
                    stack.append((inner, f"{path}[{index}]"))


def _check_unicode(name: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{name} must be valid Unicode text: a string in it holds a lone surrogate"
        ) from None


def _read_only(*_: object, **__: object) -> Any:
    raise TypeError("MethodMessage.params is read-only: make a new message to change it")


class _ReadOnlyDict(dict[Any, Any]):
    """A dict that cannot change: what ``MethodMessage.params`` holds (and every mapping
    in it). A dict still for the encoders (``json.dumps``, ``{**params, ...}``), for
    comparison and for ``dataclasses.asdict``; hashable if its values are; copied as
    itself; pickled as a dict of its class. Filled as it is made (``__new__``:
    ``__init__`` does nothing, so calling it again changes nothing); changing it
    raises ``TypeError``."""

    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __new__(cls, *args: Any, **kwargs: Any) -> _ReadOnlyDict:
        made = dict.__new__(cls)
        dict.update(made, *args, **kwargs)
        return made

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # (filled by __new__)

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ReadOnlyDict, (dict(self),))

    def __copy__(self) -> _ReadOnlyDict:
        return self

    def __deepcopy__(self, memo: object) -> _ReadOnlyDict:
        return self


class _ReadOnlyList(list[Any]):
    """A list that cannot change, as :class:`_ReadOnlyDict` is a dict (the lists and
    tuples in ``MethodMessage.params``)."""

    __slots__ = ()
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _read_only
    append = extend = insert = pop = remove = clear = sort = reverse = _read_only

    def __new__(cls, items: Iterable[Any] = ()) -> _ReadOnlyList:
        made = list.__new__(cls)
        list.extend(made, items)
        return made

    def __init__(self, items: Iterable[Any] = ()) -> None:
        pass  # (filled by __new__)

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_ReadOnlyList, (list(self),))

    def __copy__(self) -> _ReadOnlyList:
        return self

    def __deepcopy__(self, memo: object) -> _ReadOnlyList:
        return self


def _copied(params: Mapping[str, Any]) -> _ReadOnlyDict:
    """``params`` as a read-only dict, with every mapping, list and tuple in it copied
    too (as read-only dicts and lists), at any depth, without recursion. A mapping or
    list reached twice is copied once; one that holds itself (a cycle: no JSON) is a
    ``TypeError``."""
    root = _ReadOnlyDict()
    # By id, with each original kept alive meanwhile: a mapping may make its
    # values as they are read, and a freed one's id be taken by the next.
    copies: dict[int, tuple[object, _ReadOnlyDict | _ReadOnlyList]] = {id(params): (params, root)}
    stack: list[tuple[Any, _ReadOnlyDict | _ReadOnlyList]] = [(params, root)]
    shared = False
    while stack:
        source, target = stack.pop()
        put: Callable[[Any, Any, Any], None] = (
            dict.__setitem__ if isinstance(target, dict) else list.__setitem__
        )
        pairs = source.items() if isinstance(target, dict) else enumerate(source)
        for name, value in pairs:
            if not isinstance(value, (Mapping, list, tuple)):
                put(target, name, value)
                continue
            seen = copies.get(id(value))
            if seen is None:
                copy: _ReadOnlyDict | _ReadOnlyList = (
                    _ReadOnlyDict()
                    if isinstance(value, Mapping)
                    else _ReadOnlyList([None] * len(value))
                )
                copies[id(value)] = (value, copy)
                stack.append((value, copy))
            else:
                copy = seen[1]
                shared = True
            put(target, name, copy)
    if shared and _has_cycle(root):
        raise TypeError("MethodMessage.params hold a cycle (a value that holds itself): not JSON")
    return root


def _has_cycle(root: _ReadOnlyDict) -> bool:
    """Whether a container in ``root`` (read-only dicts and lists) holds itself, at any
    depth. Depth-first without recursion: a container met again while its own
    children are being walked is a cycle."""
    walking: set[int] = set()  # on the current path
    done: set[int] = set()
    stack: list[tuple[Any, Iterator[Any]]] = [(root, iter(root.values()))]
    walking.add(id(root))
    while stack:
        container, children = stack[-1]
        for child in children:
            if not isinstance(child, (dict, list)) or id(child) in done:
                continue
            if id(child) in walking:
                return True
            walking.add(id(child))
            values = child.values() if isinstance(child, dict) else child
            stack.append((child, iter(values)))
            break
        else:
            stack.pop()
            walking.discard(id(container))
            done.add(id(container))
    return False
