"""Prometheus metrics read from the ledger at scrape time.

The collector keeps nothing in process memory: each scrape reads the ledger (three aggregate reads and the
escalation counts the reconciliation sensor uses), so every process that serves it, on any host, reports the same
numbers. Plain Python; nothing here imports Dagster.

Metrics (all gauges):

* ``export_ledger_keys{export, state}``: keys of each export in each ledger state;
* ``export_ledger_needs_attention{export}``: what waits for a person, counted as the reconciliation sensor counts it
  (:meth:`Attention.summary <export_ledger.ledger.attention.Attention.summary>`): escalated keys, pending
  restatements, refused tenants and partitions whose runs never claimed;
* ``export_ledger_last_exported_window_end_timestamp_seconds{export, tenant}``: the end (Unix time) of the latest
  window whose key is completed: ``time() - value`` is how far behind the tenant is;
* ``export_ledger_up``: 1 when the ledger answered this scrape, 0 when it did not (then nothing else is reported).

Serve it with ``python -m export_ledger.metrics --ledger-url URL --port N``, or mount :func:`metrics_app` (WSGI)
in a server of your own.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

from export_ledger.errors import ConfigurationError
from export_ledger.ledger import DEFAULT_MAX_ATTEMPTS, ExportLedger, ExportState, LedgerError, redact_url
from export_ledger.settings import Settings, positive_int

log = logging.getLogger(__name__)
#: What the reconciliation sensor waits before it escalates a key (``ledgered_definitions``' default).
DEFAULT_STUCK_AFTER = dt.timedelta(hours=6)


def _prometheus():
    try:
        import prometheus_client
        from prometheus_client.core import GaugeMetricFamily
    except ImportError:
        raise ConfigurationError(
            "export_ledger.metrics needs prometheus-client: install the metrics extra "
            "(pip install 'export-ledger[metrics]')"
        ) from None
    return prometheus_client, GaugeMetricFamily


class LedgerCollector:
    """A Prometheus collector over one ledger, read at each scrape.

    Args:
        ledger: The ledger (open it with ``read_only=True``: a scrape never writes).
        stuck_after, max_attempts: When a key needs attention: pass the reconciliation sensor's values.
    """

    def __init__(
        self,
        ledger: ExportLedger,
        *,
        stuck_after: dt.timedelta = DEFAULT_STUCK_AFTER,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> None:
        _, self._gauge = _prometheus()
        self.ledger = ledger
        self.stuck_after = stuck_after
        self.max_attempts = max_attempts

    def describe(self) -> list:
        return []  # registered without a trial scrape: registering must not need the ledger to answer

    def collect(self) -> Iterator:
        up = self._gauge("export_ledger_up", "1 when the ledger answered this scrape, else 0")
        try:
            families = self._families()
        except LedgerError as exc:  # its message names the ledger with the password redacted, never the values
            log.warning("ledger unavailable for metrics: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _families(self) -> list:
        tallies = self.ledger.tallies
        by_state = tallies.keys_by_state()
        windows = tallies.last_completed_windows()
        summary = self.ledger.attention.summary(self.stuck_after, max_attempts=self.max_attempts, listed=False)
        exports = sorted({export for export, _ in by_state} | {export for export, _ in summary.groups})

        keys = self._gauge("export_ledger_keys", "Keys of each export in each ledger state", labels=["export", "state"])
        for export in exports:
            for state in ExportState:  # every state, 0 included: an alert on a state needs the series to exist
                keys.add_metric([export, state.value], by_state.get((export, state), 0))

        attention = self._gauge(
            "export_ledger_needs_attention",
            "Keys, refused tenants and never-claimed partitions waiting for a person (as the reconciliation sensor "
            "counts them)",
            labels=["export"],
        )
        waiting = dict.fromkeys(exports, 0)
        for (export, _zone), (count, _listed) in summary.groups.items():
            waiting[export] += count
        for export, count in sorted(waiting.items()):
            attention.add_metric([export], count)

        last = self._gauge(
            "export_ledger_last_exported_window_end_timestamp_seconds",
            "End (Unix time) of the latest window whose key is completed, per export and tenant",
            labels=["export", "tenant"],
        )
        for (export, tenant), end in sorted(windows.items()):
            last.add_metric([export, tenant], end.timestamp())
        return [keys, attention, last]


def registry_for(ledger: ExportLedger, **options):
    """A registry holding only :class:`LedgerCollector` (no process metrics: they would differ between servers)."""
    prometheus_client, _ = _prometheus()
    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(LedgerCollector(ledger, **options))
    return registry


def metrics_app(ledger: ExportLedger, **options):
    """A WSGI app serving the ledger's metrics, to mount in a server of your own (``options``: see
    :class:`LedgerCollector`)."""
    prometheus_client, _ = _prometheus()
    return prometheus_client.make_wsgi_app(registry_for(ledger, **options))


def serve(ledger: ExportLedger, *, port: int, host: str = "127.0.0.1", **options):
    """Serves the metrics on ``host:port`` in a background thread; returns ``(server, thread)``
    (``server.shutdown()`` stops it)."""
    prometheus_client, _ = _prometheus()
    return prometheus_client.start_http_server(port, addr=host, registry=registry_for(ledger, **options))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m export_ledger.metrics``: serves the ledger's metrics until SIGTERM or SIGINT."""
    settings = Settings.from_environment()
    parser = argparse.ArgumentParser(prog="python -m export_ledger.metrics", description=__doc__.split("\n")[0])
    parser.add_argument("--ledger-url", default=settings.ledger_url, help="default: EXPORTS_LEDGER_URL")
    parser.add_argument("--port", required=True, type=lambda text: positive_int("--port", text))
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--stuck-after-hours", type=float, default=DEFAULT_STUCK_AFTER.total_seconds() / 3600)
    parser.add_argument("--max-attempts", type=lambda text: positive_int("--max-attempts", text),
                        default=DEFAULT_MAX_ATTEMPTS)  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ledger = ExportLedger(args.ledger_url, read_only=True)
    except LedgerError as exc:  # a scrape of a ledger that goes away later reports export_ledger_up 0
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server, thread = serve(
        ledger, port=args.port, host=args.host, stuck_after=dt.timedelta(hours=args.stuck_after_hours),
        max_attempts=args.max_attempts,
    )  # fmt: skip
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    print(f"serving metrics of {redact_url(args.ledger_url)} on http://{args.host}:{args.port}/metrics", flush=True)
    stop.wait()
    server.shutdown()
    thread.join(timeout=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
