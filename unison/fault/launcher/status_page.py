"""The coordinator's read-only status page: ``/`` (HTML) and ``/status.json`` over HTTP.

Standard library only (``http.server`` in a daemon thread), so the core install
serves it. The server knows nothing of the job: it calls ``snapshot()`` for
each request and shows what comes back (``Coordinator.status``). The fields
are described in docs/fault-tolerance.md, "The status page".
"""

from __future__ import annotations

import html
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

#: Seconds between two reloads of the HTML page in the browser.
REFRESH_S = 2


class StatusPage:
    """Serve ``snapshot()`` as HTML and JSON on ``host:port`` (port 0: one the OS picks).

    Binding happens here, so a port in use fails at once (``OSError``);
    ``start()`` serves from a daemon thread, ``close()`` stops it.

    Example::

        >>> page = StatusPage(coordinator.status)  # 127.0.0.1, a port the OS picks
        >>> page.start()
        >>> page.url  # 'http://127.0.0.1:<port>/'
        >>> page.close()
    """

    def __init__(self, snapshot: Callable[[], dict[str, Any]], host: str = "127.0.0.1", port: int = 0) -> None:
        handler = type("Handler", (_Handler,), {"snapshot": staticmethod(snapshot)})
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.host, self.port = host, self.server.server_address[1]
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, name="unison-status", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self.server.shutdown()
            self._thread.join(5)
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    """GET (and HEAD) only: ``/`` and ``/index.html`` the page, ``/status.json`` the data."""

    snapshot: Callable[[], dict[str, Any]]

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            self._reply(render(self.snapshot()).encode(), "text/html; charset=utf-8")
        elif path == "/status.json":
            self._reply(json.dumps(self.snapshot(), indent=1).encode(), "application/json")
        else:
            self.send_error(404, "not found: the page is / and the data /status.json")

    def do_HEAD(self) -> None:
        self.do_GET()

    def _reply(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a browser's reloads are no news for the job's log


# ---- the page -----------------------------------------------------------------------------
STYLE = (
    "body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0 1.5em}"
    "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;font-size:14px}"
    "th{background:#f3f3f3}.failure,.abort,.stop{color:#b00}.dead,.evicted{color:#b00}"
    ".member{color:#070}.failed{color:#b00}code{background:#f3f3f3;padding:0 .3em}"
)


def render(doc: dict[str, Any]) -> str:
    """The page for one ``Coordinator.status`` snapshot (it reloads itself every ``REFRESH_S``)."""
    e = html.escape
    job = doc["job"]
    started = job["started_at"]
    step = "unknown" if doc["committed_step"] is None else doc["committed_step"]
    head = [
        ("state", job["state"] + (f": {doc['aborted']}" if doc.get("aborted") else "")),
        ("epoch", doc["epoch"]),
        ("members (rank order)", doc["members"]),
        ("committed step", step),
        ("up", f"{job['uptime_s']:.0f} s"),
        ("failures / joins / respawns", f"{len(doc['failures'])} / {len(doc['joins'])} / {len(doc['respawns'])}"),
        ("store", job["store"]),
        ("command", " ".join(job["command"]) or "(workers started elsewhere)"),
    ]
    rows = "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in head)
    nodes = "".join(
        f"<tr class='{e(n['state'])}'><td>{n['id']}</td><td>{e(n['state'])}</td><td>{n['size']}</td>"
        f"<td>{_text(n['host'])}</td><td>{e(str(n['workers']))}</td>"
        f"<td>{e(str([r for r in n['ranks'] if r is not None]) if any(r is not None for r in n['ranks']) else '')}</td>"
        f"<td>{_text(n['failure'])}</td></tr>"
        for n in doc.get("nodes", [])
    )
    workers = "".join(
        f"<tr class='{e(w['state'])}'><td>{w['id']}</td><td>{_text(w.get('node'))}</td><td>{_text(w.get('local_rank'))}</td>"
        f"<td>{_text(w['rank'])}</td><td>{_text(w['pid'])}</td>"
        f"<td>{e(w['state'])}</td><td>{_age(w['last_heartbeat_s_ago'])}</td><td>{w['heartbeats']}</td>"
        f"<td>{_clock(w['started_at'], started)}</td><td>{_clock(w['joined_at'], started)}</td>"
        f"<td>{_clock(w['ended_at'], started)}</td><td>{_text(w['exit_code'])}</td></tr>"
        for w in doc["workers"]
    )
    events = "".join(
        f"<tr class='{e(ev['kind'])}'><td>{_clock(ev['time'], started)}</td><td>{e(ev['kind'])}</td>"
        f"<td>{e(ev['detail'])}</td></tr>"
        for ev in reversed(doc["events"])
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<meta http-equiv='refresh' content='{REFRESH_S}'><title>unison job: epoch {doc['epoch']}</title>"
        f"<style>{STYLE}</style></head><body><h1>unison job</h1><table>{rows}</table>"
        "<h2>Nodes</h2><table><tr><th>node</th><th>state</th><th>processes</th><th>host</th><th>workers</th>"
        f"<th>ranks</th><th>failure</th></tr>{nodes}</table>"
        "<h2>Workers</h2><table><tr><th>id</th><th>node</th><th>local rank</th><th>rank</th><th>pid</th><th>state</th>"
        "<th>last heartbeat</th><th>heartbeats</th><th>started</th><th>joined</th><th>ended</th>"
        f"<th>exit code</th></tr>{workers}</table>"
        f"<h2>Events (newest first)</h2><table><tr><th>time</th><th>kind</th><th>detail</th></tr>{events}</table>"
        f"<p>Read-only; the same data as JSON: <a href='status.json'><code>status.json</code></a>. "
        f"Times are the launcher's clock, + seconds since the job started.</p></body></html>"
    )


def _text(value: Any) -> str:
    return "" if value is None else html.escape(str(value))


def _age(seconds: Optional[float]) -> str:
    return "" if seconds is None else f"{seconds:.1f} s ago"


def _clock(t: Optional[float], start: float) -> str:
    if t is None:
        return ""
    return f"{time.strftime('%H:%M:%S', time.localtime(t))} (+{t - start:.1f} s)"
