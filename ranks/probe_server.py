"""The probe server: ``/health``, ``/ready`` and ``/metrics`` over HTTP, one small server per process (rank 0, the
router), on a thread of its own.

Off the loop: the loop publishes a frozen ``runtime.probes.Snapshot`` (``publish``: one attribute store, atomic under
the GIL) and this thread reads only that and a ``prometheus_client`` registry (whose metric objects are thread-safe;
the rank-0 ``Exporter`` records into it from the loop). A slow or hostile scraper costs this thread, never the loop.

- ``GET /health``: 200 ``{"alive": true, ...}`` while the process answers.
- ``GET /ready``: 200 when ready, else 503; the JSON body gives the snapshot's facts and ``why_not``.
- ``GET /metrics``: the registry in Prometheus text (``prometheus_client.exposition``) plus the snapshot's series;
  503 when ``prometheus-client`` is not installed (the other two paths work without it).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from runtime.probes import STARTING, Snapshot, families

log = logging.getLogger(__name__)


class _SnapshotCollector:
    """A ``prometheus_client`` collector of the latest snapshot's series (read at scrape time, on this thread)."""

    def __init__(self, server: ProbeServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, samples in families(self.server.snapshot.samples).items():
            first = samples[0]
            keys = [k for k, _ in first.labels]
            make = CounterMetricFamily if first.kind == "counter" else GaugeMetricFamily
            family = make(name, first.help, labels=keys)
            for sample in samples:
                family.add_metric([v for _, v in sample.labels], sample.value)
            yield family


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    timeout = 5.0  # a connection that sends nothing frees its thread (one thread per connection)

    def do_GET(self) -> None:
        probes = self.server.probes
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._answer(200, "application/json", json.dumps({"alive": True, "role": probes.role}).encode())
        elif path == "/ready":
            snapshot = probes.snapshot  # one read: the body and the status agree
            body = {"ready": snapshot.ready, "why_not": list(snapshot.why_not), "role": probes.role,
                    **snapshot.facts}
            self._answer(200 if snapshot.ready else 503, "application/json", json.dumps(body).encode())
        elif path == "/metrics":
            text = probes.metrics()
            if text is None:
                self._answer(503, "text/plain", b"prometheus-client is not installed (pip install -e '.[metrics]')\n")
            else:
                self._answer(200, "text/plain; version=0.0.4; charset=utf-8", text)
        else:
            self._answer(404, "text/plain", b"not found: /health, /ready, /metrics\n")

    def _answer(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("probe %s", format % args)  # a scrape every few seconds is not worth an INFO line


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a scraper that never reads its answer does not hold the process at exit
    probes: ProbeServer


class ProbeServer:
    """The HTTP server of one process; ``publish`` from the loop, everything else from its own threads."""

    def __init__(self, host: str, port: int, role: str, registry: Any | None = None) -> None:
        self.role = role
        self.snapshot: Snapshot = STARTING
        self.registry = registry
        if registry is None:
            try:
                import prometheus_client
            except ImportError:
                log.warning("prometheus-client is not installed: /metrics answers 503 (pip install -e '.[metrics]')")
            else:
                self.registry = prometheus_client.CollectorRegistry()
        if self.registry is not None:
            self.registry.register(_SnapshotCollector(self))
        self.httpd = _HTTPServer((host, port), _Handler)
        self.httpd.probes = self
        self.host, self.port = host, self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                       name="probes", daemon=True)
        self.thread.start()
        log.info("probes on http://%s:%d (/health, /ready, /metrics)", host, self.port)

    def publish(self, snapshot: Snapshot) -> None:
        """From the loop: the probes answer from this snapshot until the next one."""
        self.snapshot = snapshot

    def metrics(self) -> bytes | None:
        if self.registry is None:
            return None
        from prometheus_client.exposition import generate_latest

        return generate_latest(self.registry)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def start(host: str, port: int, role: str, registry: Any | None = None, what: str = "the probe server"
          ) -> ProbeServer | None:
    """The probe server on ``host:port``, or None when ``port`` is 0 (off, the default). A port it cannot bind
    raises ``OSError`` naming ``what`` (the config keys): a probe that silently is not there would read as down."""
    if port <= 0:
        return None
    try:
        return ProbeServer(host, port, role, registry)
    except OSError as error:
        raise OSError(error.errno, f"cannot serve the probes on {host}:{port} ({what}): {error.strerror}") from error
