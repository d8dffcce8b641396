"""The status page as one self-contained HTML document: no framework, no CDN, no request
for anything but the page itself, so it works offline and behind any prefix.

Every value that comes from the database (keys, types, errors, relay ids)
is escaped. The page refreshes itself: a few lines of script fetch the page
again and swap its ``<main>`` (without script, a ``<meta>`` refresh does
the same), and it says so when the server cannot be reached or answers with
another page; an answer that redirects (signed out: a login page) reloads it.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Sequence
from html import escape

from outbound.errors import OutboxError
from outbound.outbox._base import STATUSES, RowInfo, Throughput

from ._monitor import RelaySeen, StatusMonitor, StatusSnapshot, snapshot_json

__all__ = ["format_age", "json_answer", "json_body", "page_answer", "render_error", "render_page"]

#: Characters of a last error shown in a table cell (the whole of it is in
#: the cell's tooltip and in ``/status.json``).
_ERROR_CHARS = 240

_STATUS_HELP = {
    "pending": "waiting to be claimed by a relay",
    "processing": "claimed: a relay is delivering it",
    "sent": "its handlers succeeded",
    "dead": "rejected, or out of attempts: inspect, then retry or purge",
    "cancelled": "taken out of line by an operator: never delivered",
}


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _n(value: int) -> str:
    return f"{value:,}"


def format_age(seconds: float | None) -> str:
    """A duration for people: ``0.4 s``, ``12 s``, ``3 min 4 s``, ``2 h 5 min``, ``3 d 4 h``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def _utc(when: float | None) -> str:
    if when is None or not math.isfinite(when):
        return ""
    try:
        moment = _dt.datetime.fromtimestamp(when, tz=_dt.timezone.utc)
    except (OverflowError, ValueError, OSError):  # (past year 9999: another program's)
        return ""
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(now: float, when: float | None) -> str:
    """``12 s ago``, with the UTC time as a tooltip."""
    if when is None:
        return "-"
    return f'<span title="{_utc(when)}">{format_age(now - when)} ago</span>'


def _rate(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}".rstrip("0").rstrip(".") if value else "0"


def _axis(value: float) -> str:
    return f"{value:,.0f}" if value == int(value) else _rate(value)


def _error_cell(text: str | None) -> str:
    if not text:
        return '<td class="error muted">-</td>'
    shown = text if len(text) <= _ERROR_CHARS else text[: _ERROR_CHARS - 1] + "\u2026"
    return f'<td class="error" title="{_e(text)}">{_e(shown)}</td>'


# ----------------------------------------------------------------- the chart


def _nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is >= ``value`` (> 0)."""
    power = 10.0 ** math.floor(math.log10(value))
    for step in (1.0, 2.0, 2.5, 5.0, 10.0):
        if step * power >= value * (1 - 1e-12):
            return step * power
    return 10.0 * power  # pragma: no cover - the loop always returns


def _chart(throughput: Throughput) -> str:
    """Sent per second as an inline SVG bar chart, oldest bucket left, now right."""
    width, height = 760, 190
    left, right, top, bottom = 48, 10, 12, 26
    plot_w, plot_h = width - left - right, height - top - bottom
    rates = throughput.per_second
    count = len(rates) or 1
    peak = max(rates, default=0.0)
    scale = _nice_ceiling(peak) if peak > 0 else 1.0
    step = plot_w / count
    window = throughput.bucket * len(rates)
    parts = [
        f'<svg id="sent-chart" class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-labelledby="sent-chart-title sent-chart-desc" preserveAspectRatio="none">',
        f'<title id="sent-chart-title">Rows sent per second, last {format_age(window)}</title>',
        f'<desc id="sent-chart-desc">{sum(throughput.sent)} rows sent; peak '
        f"{_rate(peak)} per second</desc>",
    ]
    for fraction in (0.0, 0.5, 1.0):
        y = top + plot_h * (1 - fraction)
        parts.append(
            f'<line class="grid" x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}"/>'
            f'<text class="axis" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{_axis(scale * fraction)}</text>"
        )
    for index, rate in enumerate(rates):
        bar = plot_h * rate / scale
        x = left + index * step
        begins = window - index * throughput.bucket
        ends = begins - throughput.bucket
        sent = throughput.sent[index]
        label = (
            f"{format_age(begins)} to {format_age(ends)} ago: {_rate(rate)}/s ({sent} sent)"
            if ends > 0
            else f"the last {format_age(begins)}: {_rate(rate)}/s ({sent} sent)"
        )
        parts.append(
            f'<rect class="bar" x="{x + 0.5:.2f}" y="{top + plot_h - bar:.2f}" '
            f'width="{max(step - 1.0, 0.5):.2f}" height="{bar:.2f}" data-sent="{sent}">'
            f"<title>{_e(label)}</title></rect>"
        )
    baseline = top + plot_h
    parts.append(
        f'<line class="base" x1="{left}" y1="{baseline}" x2="{width - right}" y2="{baseline}"/>'
    )
    for fraction, anchor in ((0.0, "start"), (0.5, "middle"), (1.0, "end")):
        x = left + plot_w * fraction
        ago = window * (1 - fraction)
        text = "now" if fraction == 1.0 else f"-{format_age(ago)}"
        parts.append(
            f'<text class="axis" x="{x:.1f}" y="{height - 8}" text-anchor="{anchor}">{text}</text>'
        )
    if peak == 0:
        parts.append(
            f'<text class="empty" x="{left + plot_w / 2:.1f}" y="{top + plot_h / 2:.1f}" '
            f'text-anchor="middle">nothing sent in the last {format_age(window)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


# ---------------------------------------------------------------- the tables


def _why_blocked(now: float, head: RowInfo) -> str:
    if head.status == "processing":
        owner = _e(head.lease_owner or "?")
        expiry = head.lease_expires_at
        if expiry is not None and expiry < now:
            return (
                f'<span class="warn">lease of <code>{owner}</code> ended '
                f"{format_age(now - expiry)} ago: its relay stopped</span>"
            )
        return f"running on <code>{owner}</code>, lease ends in {format_age((expiry or now) - now)}"
    return f"next try in {format_age((head.available_at or now) - now)}"


def _dead_section(snapshot: StatusSnapshot) -> str:
    total = snapshot.counts.get("dead", 0)
    rows = snapshot.dead
    heading = f'<h2>Dead rows <span class="count">{_n(total)}</span></h2>'
    if not rows:
        return f'<section id="dead">{heading}<p class="muted">No dead rows.</p></section>'
    body = "".join(
        f'<tr data-id="{row.id}"><td class="num">{row.id}</td><td><code>{_e(row.key)}</code></td>'
        f'<td class="text">{_e(row.type)}</td><td class="num">{row.attempts}</td>'
        f"<td>{_ago(snapshot.now, row.updated_at)}</td>{_error_cell(row.last_error)}</tr>"
        for row in rows
    )
    more = (
        f'<p class="muted">The newest {len(rows)} of {_n(total)}.</p>' if total > len(rows) else ""
    )
    return (
        f'<section id="dead">{heading}<table><thead><tr><th>id</th><th>key</th><th>type</th>'
        f"<th>attempts</th><th>died</th><th>last error</th></tr></thead><tbody>{body}</tbody>"
        f'</table>{more}<p class="hint">Revive with <code>python -m outbound outbox retry ID</code>'
        " (or from the admin); they go to the back of their key.</p></section>"
    )


def _blocked_section(snapshot: StatusSnapshot) -> str:
    count = _n(len(snapshot.blocked)) + ("+" if snapshot.blocked_more else "")
    heading = '<h2>Blocked keys <span class="count">' + count + "</span></h2>"
    more = (
        f'<p class="muted">The first {len(snapshot.blocked)}; more keys are blocked '
        "(<code>python -m outbound outbox blocked</code> lists them).</p>"
        if snapshot.blocked_more
        else ""
    )
    if not snapshot.blocked:
        return (
            f'<section id="blocked">{heading}<p class="muted">No key is held up: every key\'s '
            "next row is due, or being delivered.</p></section>"
        )
    body = "".join(
        f'<tr data-key="{_e(item.key)}"><td><code>{_e(item.key)}</code></td>'
        f'<td class="num">{_n(item.waiting)}</td>'
        f'<td class="num">{item.head.id}</td><td><span class="status s-{_e(item.head.status)}">'
        f'{_e(item.head.status)}</span></td><td class="num">{item.head.attempts}</td>'
        f"<td>{_why_blocked(snapshot.now, item.head)}</td>{_error_cell(item.head.last_error)}</tr>"
        for item in snapshot.blocked
    )
    return (
        f'<section id="blocked">{heading}<p class="hint">Keys whose next row cannot go out now: '
        "backing off after a failure, deferred, or held by a relay that stopped. The rows "
        "behind it wait, in order.</p>"
        "<table><thead><tr><th>key</th><th>waiting</th>"
        "<th>head row</th><th>status</th><th>attempt</th><th>why</th><th>last error</th></tr>"
        f"</thead><tbody>{body}</tbody></table>{more}</section>"
    )


def _relay_row(now: float, relay: RelaySeen) -> str:
    if relay.holding:
        expiry = relay.latest_expiry
        if expiry is not None and expiry < now:
            lease = f'<span class="warn">ended {format_age(now - expiry)} ago: stopped?</span>'
        else:
            lease = f"ends in {format_age((expiry or now) - now)}"
        state = "holding"
    else:
        lease = "-"
        idle = format_age(now - relay.last_seen)
        state = f'<span class="muted">holds nothing since {idle}</span>'
    renewed = _ago(now, relay.renewed_at) if relay.renewed_at is not None else "-"
    return (
        f'<tr data-owner="{_e(relay.owner)}"><td><code>{_e(relay.owner)}</code></td>'
        f'<td class="num">{relay.rows}</td><td class="num">{relay.slots}</td>'
        f"<td>{lease}</td><td>{renewed}</td><td>{state}</td></tr>"
    )


def _relays_section(snapshot: StatusSnapshot) -> str:
    heading = '<h2>Relays <span class="count">' + _n(len(snapshot.relays)) + "</span></h2>"
    if not snapshot.relays:
        return (
            f'<section id="relays">{heading}<p class="muted">No relay holds a row or a slot '
            "(a relay shows here while it delivers).</p></section>"
        )
    body = "".join(_relay_row(snapshot.now, relay) for relay in snapshot.relays)
    return (
        f'<section id="relays">{heading}<table><thead><tr><th>owner</th><th>rows held</th>'
        "<th>slots held</th><th>lease</th><th>last renewal</th><th>state</th></tr></thead>"
        f"<tbody>{body}</tbody></table></section>"
    )


def _capacity_section(snapshot: StatusSnapshot) -> str:
    total = len(snapshot.slots)
    if not total:
        return (
            '<section id="capacity"><h2>Capacity slots</h2><p class="muted">No capacity gate: '
            "no relay of this table runs with <code>max_concurrency</code>.</p></section>"
        )
    used = snapshot.slots_in_use
    owners: dict[str, int] = {}
    for slot in snapshot.slots:
        if slot.owner is not None:
            owners[slot.owner] = owners.get(slot.owner, 0) + 1
    held = "".join(f"<li><code>{_e(owner)}</code>: {n}</li>" for owner, n in sorted(owners.items()))
    return (
        f'<section id="capacity"><h2>Capacity slots <span class="count">{used} of {total} in use'
        f'</span></h2><meter id="slots-meter" min="0" max="{total}" value="{used}">{used} of '
        f"{total}</meter>{f'<ul class=holders>{held}</ul>' if held else ''}</section>"
    )


def _counts_section(snapshot: StatusSnapshot) -> str:
    tiles = "".join(
        f'<div class="tile s-{name}" title="{_STATUS_HELP[name]}"><div class="label">{name}</div>'
        f'<div class="value" data-count="{name}">{_n(snapshot.counts.get(name, 0))}</div></div>'
        for name in STATUSES
    )
    age = snapshot.oldest_pending_age
    extra = (
        f'<div class="tile"><div class="label">unfinished</div><div class="value" '
        f'data-count="unfinished">{_n(snapshot.unfinished)}</div></div>'
        f'<div class="tile" title="the age of the oldest pending row"><div class="label">'
        f'oldest pending</div><div class="value" id="oldest-pending">{format_age(age)}</div></div>'
    )
    return f'<section id="counts" class="tiles">{tiles}{extra}</section>'


def _throughput_section(snapshot: StatusSnapshot) -> str:
    throughput = snapshot.throughput
    rates = throughput.per_second
    latest = rates[-1] if rates else 0.0
    window = throughput.bucket * len(rates)
    average = sum(throughput.sent) / window if window else 0.0
    return (
        '<section id="throughput"><h2>Sent per second</h2><p class="figures">'
        f'now <strong id="rate-now">{_rate(latest)}/s</strong> &middot; peak '
        f"{_rate(max(rates, default=0.0))}/s &middot; average {_rate(average)}/s over "
        f"{format_age(window)} &middot; {_n(sum(throughput.sent))} sent "
        f"(buckets of {format_age(throughput.bucket)})</p>{_chart(throughput)}</section>"
    )


# ------------------------------------------------------------------ the page

_STYLE = """
:root{--bg:#f6f7f9;--card:#fff;--text:#1d2330;--muted:#6b7385;--line:#e2e5ea;
--pending:#2f6fde;--processing:#c98a04;--sent:#1f9d55;--dead:#d23c3c;--cancelled:#7a8190;
--bar:#1f9d55;--warn:#b45309}
@media (prefers-color-scheme:dark){:root{--bg:#14171c;--card:#1c2027;--text:#e6e8ec;
--muted:#9aa2b1;--line:#2c313a;--bar:#34c774;--warn:#f59e0b}}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--text);
font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif}
header,main,footer{max-width:1180px;margin:0 auto;padding:0 20px}
header{padding-top:18px}
h1{font-size:20px;margin:0}h1 code{font-size:19px}
h2{font-size:15px;margin:0 0 10px}
.where,.muted,.updated,.hint,footer{color:var(--muted)}
nav{font-size:13px;margin:0 0 6px}nav a{margin-right:14px}
.where{margin:2px 0 0}.hint{margin:8px 0}.updated{margin:6px 0 14px;font-size:13px}
#stale{background:#fde8e8;color:#8a1c1c;border:1px solid #f5b5b5;border-radius:6px;
padding:8px 12px;margin:10px 0 0}
.banner{background:#fde8e8;color:#8a1c1c;border:1px solid #f5b5b5;border-radius:6px;
padding:10px 14px}
section{background:var(--card);border:1px solid var(--line);border-radius:8px;
padding:14px 16px;margin:0 0 14px}
.tiles{display:grid;grid-template-columns:repeat(auto-fit,minmax(140px,1fr));gap:10px;
background:none;border:0;padding:0}
.tile{background:var(--card);border:1px solid var(--line);border-radius:8px;padding:10px 12px;
border-top:4px solid var(--line)}
.tile .label{color:var(--muted);font-size:12px;white-space:nowrap;text-transform:uppercase;
letter-spacing:.03em;overflow:hidden;text-overflow:ellipsis}
.tile .value{font-size:24px;font-weight:600;font-variant-numeric:tabular-nums}
.tile.s-pending{border-top-color:var(--pending)}.tile.s-processing{border-top-color:var(--processing)}
.tile.s-sent{border-top-color:var(--sent)}.tile.s-dead{border-top-color:var(--dead)}
.tile.s-cancelled{border-top-color:var(--cancelled)}
.count{color:var(--muted);font-weight:400;margin-left:6px}
.figures{margin:0 0 8px;color:var(--muted)}.figures strong{color:var(--text)}
svg.chart{width:100%;height:190px;display:block}
svg .bar{fill:var(--bar)}svg .bar:hover{opacity:.75}
svg .grid{stroke:var(--line);stroke-width:1}svg .base{stroke:var(--muted);stroke-width:1}
svg .axis{fill:var(--muted);font-size:11px}svg .empty{fill:var(--muted);font-size:13px}
table{width:100%;border-collapse:collapse;font-size:13px}
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid var(--line);vertical-align:top}
th{color:var(--muted);font-weight:500}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
td.error{color:var(--dead);overflow-wrap:anywhere;max-width:480px}
td code,td.text,.holders code{overflow-wrap:anywhere}
td.error.muted{color:var(--muted)}
code{font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.status{display:inline-block;padding:0 7px;border-radius:9px;font-size:12px;color:#fff;
background:var(--cancelled)}
.s-pending.status{background:var(--pending)}.s-processing.status{background:var(--processing)}
.warn{color:var(--warn)}
meter{width:100%;height:16px}
.holders{margin:8px 0 0;padding-left:18px}
#relays td{white-space:nowrap}#relays td:first-child{white-space:normal}
.grid2{display:grid;grid-template-columns:3fr 2fr;gap:14px}
.grid2 section{margin:0}
@media (max-width:900px){.grid2{grid-template-columns:1fr}}
.bottom{margin-bottom:14px}
footer{font-size:12px;padding-bottom:24px}
a{color:var(--pending)}
"""

# Fetches the page again every data-refresh seconds (at least every quarter
# second) and swaps <main>; shows #stale while the server cannot be reached or
# does not answer within max(10 s, three refreshes) (a frozen server still
# takes connections); skips hidden tabs.
_SCRIPT = """
(function () {
  var every = parseFloat(document.body.getAttribute("data-refresh")) * 1000;
  if (!(every > 0)) return;
  every = Math.max(every, 250);
  var patience = Math.max(10000, 3 * every);
  var stale = document.getElementById("stale");
  function schedule() { window.setTimeout(tick, every); }
  function tick() {
    if (document.hidden) { schedule(); return; }
    var controller = window.AbortController ? new AbortController() : null;
    var timer = controller ? window.setTimeout(function () { controller.abort(); }, patience) : 0;
    var options = {cache: "no-store", credentials: "same-origin", redirect: "manual"};
    if (controller) options.signal = controller.signal;
    var moved = false;
    fetch(window.location.href, options)
      .then(function (response) {
        if (response.type === "opaqueredirect") {
          // Sent elsewhere (signed out: a login page, maybe another site's,
          // which a fetch could not read): go there as a browser would.
          moved = true;
          window.location.reload();
          return null;
        }
        if (response.status !== 200 && response.status !== 503) {
          throw new Error("it answered HTTP " + response.status);
        }
        return response.text();
      })
      .then(function (text) {
        if (text === null) return;
        var page = new DOMParser().parseFromString(text, "text/html");
        var fresh = page.querySelector("main#outbox-status");
        if (!fresh) throw new Error("its answer is not this page");
        document.querySelector("main#outbox-status").replaceWith(fresh);
        document.title = page.title;
        stale.hidden = true;
      })
      .catch(function (error) {
        var why = error && error.name === "AbortError" ?
          "no answer within " + patience / 1000 + " s" : error.message;
        stale.textContent = "The status server cannot be reached (" + why +
          "); showing what it said last. Trying again every " + every / 1000 + " s.";
        stale.hidden = false;
      })
      .then(function () { window.clearTimeout(timer); if (!moved) schedule(); });
  }
  schedule();
})();
"""


def _document(title: str, main: str, *, refresh: float, header: str) -> str:
    from outbound import __version__  # noqa: PLC0415 - the package imports this module

    refresh_attr = f"{refresh:g}" if refresh > 0 else "0"
    meta = (
        f'<noscript><meta http-equiv="refresh" content="{max(1, round(refresh))}"></noscript>'
        if refresh > 0
        else ""
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="robots" content="noindex">'
        f"<title>{_e(title)}</title>{meta}<style>{_STYLE}</style></head>"
        f'<body data-refresh="{refresh_attr}"><header>{header}'
        '<p id="stale" role="status" hidden></p></header>'
        f"{main}<footer>Read-only status page of "
        f'<a href="https://pypi.org/project/outbound-dispatcher/">outbound</a> {_e(__version__)}'
        f"{f' &middot; refreshes every {refresh:g} s' if refresh > 0 else ''}</footer>"
        f"<script>{_SCRIPT}</script></body></html>"
    )


def _header(table: str, database: str, links: Sequence[tuple[str, str]]) -> str:
    nav = "".join(f'<a href="{_e(url)}">{_e(text)}</a>' for text, url in links)
    return (
        f"{f'<nav>{nav}</nav>' if nav else ''}<h1>Outbox <code>{_e(table)}</code></h1>"
        f'<p class="where">{_e(database)}</p>'
    )


def render_page(
    snapshot: StatusSnapshot,
    *,
    refresh: float = 2.0,
    json_url: str = "status.json",
    links: Sequence[tuple[str, str]] = (),
) -> str:
    """The status page of ``snapshot`` as a complete HTML document.

    ``refresh``: seconds between its own refreshes (0: never).
    ``json_url``: where the page links the same data as JSON. ``links``:
    (text, URL) pairs shown above the title (back to the app, say).
    """
    counts = snapshot.counts
    title = (
        f"outbox {snapshot.table}: {_n(counts.get('pending', 0))} pending, "
        f"{_n(counts.get('dead', 0))} dead"
    )
    main = (
        f'<main id="outbox-status" data-now="{snapshot.now:.3f}"><p class="updated">Read at '
        f'{_utc(snapshot.now)} in {snapshot.took * 1000:.0f} ms &middot; <a href="{_e(json_url)}">'
        f"the same as JSON</a></p>{_counts_section(snapshot)}{_throughput_section(snapshot)}"
        f"{_dead_section(snapshot)}{_blocked_section(snapshot)}"
        f'<div class="grid2 bottom">{_relays_section(snapshot)}{_capacity_section(snapshot)}</div>'
        "</main>"
    )
    return _document(
        title, main, refresh=refresh, header=_header(snapshot.table, snapshot.database, links)
    )


def render_error(
    table: str,
    database: str,
    message: str,
    *,
    refresh: float = 2.0,
    links: Sequence[tuple[str, str]] = (),
) -> str:
    """A page saying the outbox cannot be read now (it keeps trying, like the page)."""
    main = (
        f'<main id="outbox-status"><p class="banner" id="error" role="alert">The outbox '
        f"cannot be read: "
        f"{_e(message)}</p></main>"
    )
    return _document(
        f"outbox {table}: cannot be read",
        main,
        refresh=refresh,
        header=_header(table, database, links),
    )


def _sendable(text: str) -> str:
    """``text`` as it can be encoded in UTF-8: a lone surrogate (a file name's byte that
    is not UTF-8, in some message) replaced."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def page_answer(
    monitor: StatusMonitor,
    *,
    refresh: float,
    json_url: str,
    links: Sequence[tuple[str, str]] = (),
) -> tuple[int, str]:
    """(HTTP status, HTML): the page of a fresh snapshot (200), or a page saying why the
    outbox cannot be read (503). Blocks on the database."""
    table = monitor.store.table
    try:
        snapshot = monitor.snapshot()
    except OutboxError as exc:
        text = render_error(table, monitor.database, str(exc), refresh=refresh, links=links)
        return 503, _sendable(text)
    try:
        text = render_page(snapshot, refresh=refresh, json_url=json_url, links=links)
    except Exception as exc:
        reason = monitor.cannot_show(exc)
        text = render_error(table, monitor.database, reason, refresh=refresh, links=links)
        return 503, _sendable(text)
    return 200, _sendable(text)


def _finite(data: object) -> object:
    """``data`` with every float that is not finite (JSON has none) made None."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite(value) for value in data]
    return data


def json_body(data: object) -> bytes:
    """``data`` as the UTF-8 JSON the status endpoints send: a float that is not finite
    (another program's value in a row) is null, a lone surrogate replaced."""
    try:
        text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(data), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8", "replace")


def json_answer(monitor: StatusMonitor) -> tuple[int, bytes]:
    """(HTTP status, JSON): a fresh snapshot (200), or ``{"error": ...}`` (503)."""
    try:
        snapshot = monitor.snapshot()
    except OutboxError as exc:
        return 503, json_body({"error": str(exc)})
    try:
        return 200, json_body(snapshot_json(snapshot))
    except Exception as exc:
        return 503, json_body({"error": monitor.cannot_show(exc)})
