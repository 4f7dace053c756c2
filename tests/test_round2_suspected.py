"""Issue 18, round 2 — the six "suspected, not reproduced" findings (S1 to S6), on protocol v2.

Each test is the one that failed on 0.4.0 (07f55b3) where the suspicion was real, ported to the reworked API with its
scenario and its "must hold" assertion. Helpers are in ``round2_support.py``. S4 is tried at a small scale (a small
multipart threshold and a small file, against a small server that refuses single PUTs above its limit as AWS does
above 5 GiB): a real 5 GiB upload through that server took 54 to 92 s on the 2-core machine (about 35 s of CPU:
botocore's SHA-256 payload signature and CRC32 of every part, and the loopback transfer), more than the minute the
slow tier allows it, so it is not kept.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import http.server
import re
import threading
import tracemalloc
import uuid
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import numpy as np
import pandas as pd
import pytest
import sqlalchemy as sa
from pipeline_helpers import JOB, make_defs, tick

from assets.invoices import INVOICE_SCHEMA
from export_ledger.dagster import LedgerResource
from export_ledger.dagster.sensors import SITUATION_TAG
from export_ledger.destinations.base import DestinationError, Verdict
from export_ledger.destinations.table import SqlTableDestination
from export_ledger.errors import ExportLedgerError
from export_ledger.failpoints import ENV_VAR as FAILPOINTS
from export_ledger.failpoints import SimulatedCrash
from export_ledger.ledger import ExportLedger, ExportState, ResolutionRefused
from export_ledger.protocol import ExportItem, export_key, target_for
from export_ledger.reconcile import reconcile_batch
from export_ledger.resolve import resolve_key
from export_ledger.sources import CallableSource
from resources.invoices import SampleInvoiceSource
from tests.builders import evidence_for, key_for, overlapping_writers
from tests.round2_support import (  # noqa: F401  (fixtures: ledger, local)
    DAY,
    SCHEMA,
    item,
    ledger,
    local,
    s3_destination,
)

PARTITION = "2026-03-08"
ACME = "invoice_export/acme/2026-03-08T05:00:00Z"


# -- S1. a PostgreSQL deadlock between complete_many (item order) and claim_many (key order) ------------------------


@pytest.mark.postgres
def test_overlapping_backfills_never_deadlock_between_complete_many_and_claim_many(postgres_url, postgres_admin_url):
    """Suspected S1: run 1 completes its group (its first row update done, the second about to run) while an
    overlapping backfill claims the same keys, locking them in logical key order (tenant first). Neither may fail
    with a deadlock. (v2: the pause is before run 1's second update of export_runs whichever key it is, so that run 1
    always holds one row lock when run 2 arrives; 0.4.0 updated in item order: x first, then y. v3: a group's finish
    on PostgreSQL locks its rows in key order and then updates them in one statement: the pause is before the second
    of those statements that lock rows, so run 1 holds its locks when run 2 arrives, whichever form it takes.)
    Fails on 0.4.0 (07f55b3): DeadlockDetected between complete_many and claim_many."""
    book = ExportLedger(postgres_url)
    x = key_for(dt.date(2026, 3, 1), tenant="tb")  # first in item order (the earlier date)
    y = key_for(dt.date(2026, 3, 2), tenant="ta")  # first in key order (tenant ta sorts before tb)
    assert str(y) < str(x)
    cx, cy = book.claims.claim_many([x, y], "run-1/export")
    completions = [(cx, evidence_for(cx)), (cy, evidence_for(cy))]

    def complete_many():  # run 1
        return book.completions.complete_many(completions)

    def claim_many():  # run 2
        return book.claims.claim_many([x, y], "run-2/export")

    outcomes, waited = overlapping_writers(postgres_admin_url, complete_many, claim_many)
    assert waited, f"run 2 waited for a row lock of run 1 (the overlap happened): {outcomes}"
    assert all(v.startswith("ok") for v in outcomes.values()) and len(outcomes) == 2, outcomes
    assert {book.queries.get(str(k)).state for k in (x, y)} == {ExportState.COMPLETED}, outcomes


# -- S2. atomic() embedding the driver's message ------------------------------------------------------------------


@pytest.mark.postgres
def test_a_driver_message_quoting_a_row_never_reaches_the_ledger_through_atomic(postgres_url):
    """Suspected S2: `ExportLedger.atomic()` turns any OperationalError into LedgerUnavailable with the driver's text,
    and LedgerUnavailable's words are stored and logged as the library's own. A driver message that quotes a row
    (here a deferred constraint trigger on the ledger-table destination, failing at COMMIT with SQLSTATE 55000, an
    OperationalError, and quoting the row's customer_email) must never reach the attempts table.
    Fails on 0.4.0 (07f55b3): a driver's message quoting a row stored in export_attempts."""
    book = ExportLedger(postgres_url)
    destination = SqlTableDestination(url=postgres_url, table="exported_invoices")
    source = SampleInvoiceSource()

    def invoices(key) -> ExportItem:
        rows = source.rows("acme", key.window.start_utc, key.window.end_utc)
        return ExportItem(key, key.window.business_date.isoformat(), rows)

    first = key_for(dt.date(2026, 3, 7))
    export_key(book, destination, INVOICE_SCHEMA, invoices(first), "run-1/invoice_export")  # makes the tables
    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(sa.text(
            "CREATE FUNCTION refuse_invoice() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'refused invoice of %', NEW.customer_email USING ERRCODE = '55000'; END $$"
        ))  # fmt: skip
        conn.execute(sa.text(
            "CREATE CONSTRAINT TRIGGER refuse_invoices AFTER INSERT ON exported_invoices "
            "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_invoice()"
        ))  # fmt: skip
    engine.dispose()
    key = key_for(DAY)
    with pytest.raises(Exception) as raised:
        export_key(book, destination, INVOICE_SCHEMA, invoices(key), "run-2/invoice_export")
    stored = " ".join(a.error_message or "" for a in book.queries.attempts(str(key)))
    observed = {"stored in export_attempts": stored[-160:], "raised": type(raised.value).__name__}
    assert stored, f"the failure is recorded on the key: {observed}"
    assert "@example.com" not in stored and "@example.com" not in str(raised.value), observed
    assert book.queries.get(str(key)).state is ExportState.FAILED, observed


# -- S3. read_data reads a whole data object into memory -----------------------------------------------------------


def test_reconciling_a_large_published_export_reads_it_in_bounded_memory(ledger, local, clock, monkeypatch):
    """Suspected S3: `read_data` returns the whole data object as bytes, so repair, examine and resolve hold a whole
    export in memory (a streamed key may be larger than memory). Reconciling a committed, unrecorded 30 MB export
    (and v2's one `verify`, which every party uses) must stay within a few MiB, as its streamed write does.
    Fails on 0.4.0 (07f55b3): reconciling a 32.6 MiB export peaks at 32.7 MiB."""
    key = key_for(DAY)
    rows = 600_000
    start = pd.Timestamp(key.window.start_utc)
    step = (pd.Timestamp(key.window.end_utc) - start) / rows

    def big(tenant, start_utc, end_utc):
        for first in range(0, rows, 50_000):  # streamed: the write holds one batch at a time
            n = np.arange(first, first + 50_000)
            yield pd.DataFrame({
                "order_id": [f"acme-{i:09d}" for i in n], "tenant": "acme",
                "placed_at": pd.date_range(start + step * first, periods=len(n), freq=step).as_unit("us"),
                "total": 12.5,
            })  # fmt: skip

    monkeypatch.setenv(FAILPOINTS, "after_publish=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, local, SCHEMA, ExportItem.streamed(key, DAY.isoformat(), CallableSource(big), SCHEMA), "r1")
    monkeypatch.delenv(FAILPOINTS)
    pointer = local.pointer(target_for(key))
    size = sum(p.stat().st_size for p in (Path(local.root) / "/".join(target_for(key).parts) / pointer.place).iterdir())
    peaks = {}
    tracemalloc.start()
    try:
        verification = local.verify(target_for(key), logical_key=str(key), superseded=0)
        peaks["verify"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        clock.advance(minutes=16)
        report = reconcile_batch(ledger, local, limit=10, after=None, reconciler="reconciliation_sensor")
        peaks["reconcile"] = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    observed = {
        "export size (MiB)": round(size / 2**20, 1),
        "peak Python allocation (MiB)": {what: round(peak / 2**20, 1) for what, peak in peaks.items()},
        "verdicts": [verification.verdict.value, *(f.verdict.value for f in report.findings)],
    }
    assert size > 25 * 2**20 and observed["verdicts"] == ["published", "completed"], observed
    assert all(peak < 8 * 2**20 for peak in peaks.values()), observed


# -- S4. single-PUT uploads refused above 5 GB ---------------------------------------------------------------------

_FIVE_GIB = 5 * 2**30
_ETAG = re.compile(r'"?([0-9a-f]+)"?')


class _AwsLimits(http.server.BaseHTTPRequestHandler):
    """Just enough of an S3 endpoint for an export, with AWS's documented PutObject limit (scaled by
    ``max_single_put``): a single PUT larger than that is answered 400 EntityTooLarge before its body is read (as AWS
    does), parts and multipart uploads are accepted. Conditional writes (``If-None-Match: *``, ``If-Match``) are
    honoured, as the destination's startup check requires. Every request is recorded in ``seen``."""

    protocol_version = "HTTP/1.1"
    max_single_put = _FIVE_GIB
    seen: list = []
    objects: dict = {}
    uploads: dict = {}
    lock = threading.Lock()

    def log_message(self, *args) -> None:
        pass

    def _reply(self, status: int, body: bytes = b"", headers: dict | None = None, close: bool = False) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(name, value)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _where(self) -> tuple[str, dict]:
        parts = urlsplit(self.path)
        return unquote(parts.path), {k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}

    def _size(self) -> int:
        return int(self.headers.get("x-amz-decoded-content-length") or self.headers.get("Content-Length") or 0)

    def _single_put(self) -> bool:
        return self.command == "PUT" and "partNumber" not in self._where()[1]

    def _body(self):
        """The request's payload, decoded from aws-chunked framing when botocore streams with a trailing checksum;
        yields it in pieces."""
        remaining = int(self.headers.get("Content-Length") or 0)
        if "aws-chunked" not in (self.headers.get("Content-Encoding") or ""):
            while remaining:
                piece = self.rfile.read(min(remaining, 1 << 20))
                remaining -= len(piece)
                yield piece
            return
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b""):  # trailers
                    pass
                return
            left = size
            while left:
                piece = self.rfile.read(min(left, 1 << 20))
                left -= len(piece)
                yield piece
            self.rfile.readline()

    def handle_expect_100(self) -> bool:
        if self._single_put() and self._size() > self.max_single_put:
            self.seen.append(("PUT", self._where()[0], self._size(), "refused before the body"))
            error = b"<Error><Code>EntityTooLarge</Code><Message>Your proposed upload exceeds the maximum allowed size"
            self._reply(400, error + b"</Message></Error>", {"Content-Type": "application/xml"}, close=True)
            return False
        return super().handle_expect_100()

    def do_GET(self) -> None:
        path, query = self._where()
        if query.get("list-type") == "2":
            prefix = "/" + path.strip("/") + "/" + query.get("prefix", "")
            with self.lock:
                names = sorted(name for name in self.objects if name.startswith(prefix))
            bucket = "/" + path.strip("/") + "/"
            contents = "".join(
                f"<Contents><Key>{name[len(bucket):]}</Key><LastModified>2026-12-01T00:00:00.000Z</LastModified>"
                f"<Size>{len(self.objects[name][0])}</Size></Contents>"
                for name in names
            )
            self.seen.append(("GET", path, 0, "list"))
            body = (f'<?xml version="1.0"?><ListBucketResult><IsTruncated>false</IsTruncated><KeyCount>{len(names)}'
                    f"</KeyCount>{contents}</ListBucketResult>").encode()  # fmt: skip
            self._reply(200, body, {"Content-Type": "application/xml"})
            return
        self.seen.append(("GET", path, 0, ""))
        with self.lock:
            found = self.objects.get(path)
        if found is None:
            self._reply(404, b"<Error><Code>NoSuchKey</Code></Error>", {"Content-Type": "application/xml"})
            return
        self._reply(200, found[0], {"ETag": f'"{found[1]}"', "Content-Type": "application/octet-stream"})

    def do_PUT(self) -> None:
        path, query = self._where()
        size = self._size()
        if "partNumber" in query:
            data = b"".join(self._body())
            with self.lock:
                self.uploads[query["uploadId"]][int(query["partNumber"])] = data
            self.seen.append(("PUT", path, size, "part"))
            self._reply(200, headers={"ETag": f'"{hashlib.md5(data).hexdigest()}"'})
            return
        if size > self.max_single_put:  # a client that did not wait for 100-continue
            self.seen.append(("PUT", path, size, "refused"))
            self._reply(400, b"<Error><Code>EntityTooLarge</Code></Error>", close=True)
            return
        data = b"".join(self._body())
        self.seen.append(("PUT", path, size, ""))
        with self.lock:
            found = self.objects.get(path)
            absent_only = self.headers.get("If-None-Match") == "*"
            match = self.headers.get("If-Match")
            if (absent_only and found is not None) or (match is not None and (found is None or
                                                                             _ETAG.fullmatch(match)[1] != found[1])):
                self._reply(412, b"<Error><Code>PreconditionFailed</Code></Error>", {"Content-Type": "application/xml"})
                return
            etag = hashlib.md5(data).hexdigest()
            self.objects[path] = (data, etag)
        self._reply(200, headers={"ETag": f'"{etag}"'})

    def do_POST(self) -> None:
        path, query = self._where()
        body = b"".join(self._body())
        if "uploads" in query:
            upload_id = uuid.uuid4().hex
            with self.lock:
                self.uploads[upload_id] = {}
            self.seen.append(("POST", path, 0, "create multipart"))
            xml = (f"<InitiateMultipartUploadResult><Bucket>b</Bucket><Key>{path}</Key><UploadId>{upload_id}"
                   "</UploadId></InitiateMultipartUploadResult>").encode()  # fmt: skip
            self._reply(200, xml, {"Content-Type": "application/xml"})
            return
        numbers = [int(n) for n in re.findall(rb"<PartNumber>(\d+)</PartNumber>", body)]
        with self.lock:
            parts = self.uploads.pop(query["uploadId"])
            data = b"".join(parts[n] for n in numbers)
            etag = hashlib.md5(data).hexdigest() + f"-{len(numbers)}"
            self.objects[path] = (data, etag)
        self.seen.append(("POST", path, 0, f"complete multipart of {len(numbers)} parts"))
        xml = f"<CompleteMultipartUploadResult><Key>{path}</Key><ETag>\"{etag}\"</ETag></CompleteMultipartUploadResult>"
        self._reply(200, xml.encode(), {"Content-Type": "application/xml"})

    def do_DELETE(self) -> None:
        path, query = self._where()
        self.seen.append(("DELETE", path, 0, ""))
        with self.lock:
            if "uploadId" in query:
                self.uploads.pop(query["uploadId"], None)
            else:
                self.objects.pop(path, None)
        self._reply(204)


def _aws_limits_server(max_single_put: int):
    handler = type("_Limits", (_AwsLimits,), {
        "max_single_put": max_single_put, "seen": [], "objects": {}, "uploads": {}, "lock": threading.Lock(),
    })  # fmt: skip
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler


def test_an_export_larger_than_the_single_put_limit_is_uploaded_in_parts_not_refused_as_one_put(ledger):
    """Suspected S4: the S3 destination writes the data object with one PutObject whatever its size; AWS refuses a
    single PUT above 5 GiB, so such an export can never be published. It must be uploaded in parts (multipart).
    Default tier: the same at a small scale (a store refusing single PUTs above 256 KiB, the destination's
    multipart threshold 256 KiB and parts of 100 KiB, a data file of about 1 MiB), through the whole protocol.
    Fails on 0.4.0 (07f55b3): one 5 GiB+1 PUT refused with HTTP 400, no multipart."""
    limit = 256 << 10
    server, handler = _aws_limits_server(limit)
    try:
        destination = s3_destination(
            f"exports-{uuid.uuid4().hex[:8]}", f"http://127.0.0.1:{server.server_port}", read_timeout_seconds=30,
            multipart_threshold_bytes=limit, part_size_bytes=100 << 10,
        )  # fmt: skip
        key = key_for(DAY)
        times = pd.date_range(key.window.start_utc, key.window.end_utc, periods=20_000, inclusive="left")
        frame = pd.DataFrame({
            "order_id": [f"acme-{i:09d}" for i in range(len(times))], "tenant": "acme",
            "placed_at": times.as_unit("us"), "total": 12.5,
        })  # fmt: skip
        try:
            result = export_key(ledger, destination, SCHEMA, ExportItem(key, DAY.isoformat(), frame), "run-1/export")
            outcome = result.status
        except DestinationError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        data = [s for s in handler.seen if "/r1-t1/data.csv" in s[1]]
        target = target_for(key, 1, "r1-t1")
        seen = destination.verify_recorded(target, logical_key=str(key), sha256=ledger.queries.get(str(key)).sha256)
    finally:
        server.shutdown()
        server.server_close()
    observed = {"outcome": outcome[:200], "data object requests": data, "verified": seen.verdict.value}
    single = [s for s in data if s[0] == "PUT" and s[3] != "part"]
    parts = [s for s in data if s[3] == "part"]
    assert outcome == "exported" and not single, observed
    assert len(parts) >= 3 and all(size <= limit for _, _, size, _ in parts), observed
    assert seen.verdict is Verdict.PUBLISHED, f"what readers get is the whole data file: {observed}"


# -- S5. raw botocore errors from deletes ---------------------------------------------------------------------------


def test_a_failed_s3_delete_is_the_librarys_destination_error_not_a_raw_botocore_error(
    ledger, clock, s3_bucket, fault_proxy, monkeypatch
):
    """Suspected S5: `discard_target` and `discard_abandoned` call delete_object bare. A delete answered 500 must be
    a classified DestinationError (as every other S3 call is), not a raw botocore ClientError. (v2: every delete goes
    through the store's `delete` hook; `resolve_key` reports a failed action as ResolutionRefused, in the library's
    own words, with the key put back and the refusal logged, so the classification is read from its message, and
    from the hook itself.)
    Fails on 0.4.0 (07f55b3): raw botocore ClientError escapes resolve_key."""
    destination = s3_destination(s3_bucket, fault_proxy.endpoint_url)
    key = key_for(DAY)
    monkeypatch.setenv(FAILPOINTS, "after_publish=crash")
    with pytest.raises(SimulatedCrash):
        export_key(ledger, destination, SCHEMA, item(key), "run-1/export")
    monkeypatch.delenv(FAILPOINTS)
    clock.advance(minutes=16)
    fault_proxy.inject("error_500", method="DELETE")
    try:
        resolve_key(ledger, destination, str(key), action="discard-destination", operator="ops", reason="bad rows")
        raised = None
    except Exception as exc:
        raised = exc
    assert fault_proxy.remaining == 0, "the discard's delete was answered 500"
    observed = {
        "raised": f"{type(raised).__module__}.{type(raised).__name__}: {str(raised)[:160]}" if raised else None,
        "state after": ledger.queries.get(str(key)).state.value,
    }
    assert raised is None or isinstance(raised, ExportLedgerError), observed
    assert raised is None or (isinstance(raised, ResolutionRefused) and "cannot delete" in str(raised)), observed

    fault_proxy.inject("error_500", method="DELETE")
    with pytest.raises(DestinationError, match="cannot delete"):
        destination.store.delete(f"{key.export}/tenant={key.tenant}/date={DAY.isoformat()}/r1-t1/data.csv")


# -- S6. a rerun run that fails before its claim gets one automatic rerun instead of three -------------------------


def test_a_rerun_that_fails_before_its_claim_still_gets_the_remaining_automatic_reruns(
    tmp_path, instance, clocked_ledger, clock
):
    """Suspected S6: the rerun's run key names each failed key with its fencing token. A rerun run that fails before
    it claims leaves the token as it was, so the next tick repeats the run key and Dagster launches nothing: the key
    gets one automatic rerun, not three, and is not escalated either (until stuck_after). (v2 reads a source after
    the claim, so "fails before its claim" is a run whose ledger cannot be opened; it runs in the instance with the
    sensor's tags, `export-ledger/rerun-of=<situation>`, as the daemon launches it.)
    Fails on 0.4.0 (07f55b3): the second tick repeats the rerun run key after a run that failed before its claim."""
    defs = make_defs(tmp_path, tenants=["acme"], ledger=clocked_ledger)
    (tmp_path / "a-file").write_text("not a folder")  # the ledger cannot be opened beneath it
    unreachable = LedgerResource(url=f"sqlite:///{tmp_path / 'a-file' / 'ledger.sqlite3'}")
    down = make_defs(tmp_path, tenants=["acme"], ledger=unreachable, destination=str(tmp_path / "elsewhere"))
    book = clocked_ledger.get_ledger()
    book.completions.fail(book.claims.claim(key_for(), "run-1/invoice_export"), RuntimeError("source down"))
    run_keys, cursor = [], None
    for _ in range(4):
        result = tick(defs, instance, cursor)
        cursor = result.cursor
        requests = [r for r in result.result.run_requests if r.partition_key == PARTITION]
        run_keys.append([r.run_key for r in requests])
        for request in requests:  # the run the sensor asked for: it fails before it claims anything
            rerun = down.resolve_job_def(JOB).execute_in_process(
                partition_key=PARTITION, instance=instance, tags=request.tags, raise_on_error=False
            )
            assert not rerun.success and request.tags.get(SITUATION_TAG)
        clock.advance(minutes=5)
    record = book.queries.get(ACME)
    observed = {
        "run keys per tick": run_keys,
        "claims so far": record.claim_count,
        "state": record.state.value,
    }
    launched = [keys[0] for keys in run_keys if keys]
    assert len(launched) == 3 and len(set(launched)) == 3, f"three automatic reruns, each a new run key: {observed}"
    assert run_keys[3] == [], f"then no more: {observed}"
    assert (record.claim_count, record.state) == (1, ExportState.FAILED), observed
    clock.advance(hours=7)  # longer than stuck_after: the key whose reruns never claimed it waits for a person
    escalated = [e.logical_key for e in book.attention.needs_attention(dt.timedelta(hours=6))]
    assert escalated == [ACME], observed
