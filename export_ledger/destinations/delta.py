"""A Delta Lake destination: a key's rows and its completion marker are one Delta commit (``delta:PATH_OR_URL``).

One table per export (``{export}`` in the spec is replaced by the export's name). Every row carries the key it
belongs to (``_export_key``, the partition column) and its row number in the export (``_export_row``). A commit that
publishes revision ``r`` of key ``K`` with fencing token ``t`` holds, in one Delta log entry:

* the key's rows: appended for revision 1; for a restatement, a predicate overwrite (``_export_key = K``) that removes
  exactly the key's earlier rows and adds the new ones (remove and add actions of the same commit);
* transaction actions (``txn``): ``K`` at version ``r`` (what any reader asks: ``DeltaTable.transaction_version(K)``),
  ``K#fence`` at ``t``, ``K#r<r>`` at the table version the commit was made from plus one (the commit is the first
  log entry from there carrying ``K#r<r>``: Delta may have rebased it over other keys' commits), and the key's folder
  (``<export>/tenant=<t>/date=<D>``) at the window start in epoch seconds (so that a target, which names a business
  date, finds its key);
* commit metadata: the revision's manifest (attempt, fencing token, sha256 of the rows' CSV serialization, row count)
  and the export's column names in its own order (``export_ledger.columns``): the order the sha256 was taken in.

**Reading back.** A key's current revision is read from the table's latest version (its rows are the key's rows
there, whatever OPTIMIZE or VACUUM did since), its columns selected by name in the order the commit recorded; only a
superseded revision is read by time travel to its commit, and VACUUM may have removed its files.

**The fence** is ``K#fence``. A party raises it with an empty commit (``fence``); every commit carries ``K#fence`` and
is made from the table version read when the fence and the key's revision were checked. Delta rebases a commit over
later commits that share none of its ``txn`` app ids, read none of its data and change no metadata (other keys'
commits), and refuses it otherwise (delta-rs' conflict checker: a shared app id is ``ConcurrentTransaction``), so a
fence or commit of the same key that landed after the read makes this commit fail, and the party reads again. So a
party whose token is below the fence read can never commit, and a fence that lands after its read makes its commit
fail and be judged again. Readers see only committed table versions: a key's rows appear all at once or not at all.

**Columns**: an export whose columns differ from the table's (one dropped, added, retyped or made nullable) is
refused before anything is written, naming the columns; a reordered export is written by name. So are a restatement
of an append-only table (``delta.appendOnly``), and what Delta itself refuses before writing a log entry: rows that
break the table's CHECK constraints, invariants or generated columns, a protocol needing a writer feature deltalake
lacks (each named from the table's metadata, never a row). Only a lost race is read again and retried.

**Retention**: ``delta.setTransactionRetentionDuration`` (txn identifiers) and ``delta.logRetentionDuration`` (the
commit entries holding the manifests) are set to ``retention_days`` when the table is created, and
``delta.deletedFileRetentionDuration`` (what VACUUM keeps of files the latest version no longer references) to
``file_retention_days``; a table whose settings are shorter is refused before anything is written or judged.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import io
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from export_ledger.calendar import utc_iso
from export_ledger.destinations.base import (
    DestinationError,
    DestinationUnreachable,
    ExportTarget,
    Fenced,
    PointerMoved,
    PublishOutcomeUnknown,
    Verdict,
    Verification,
    judge,
    place_name,
)
from export_ledger.destinations.pointer import Pointer, PointerDestination, StagedExport
from export_ledger.destinations.registry import Scheme
from export_ledger.destinations.s3 import SCHEME as S3_SCHEME
from export_ledger.destinations.s3 import S3Destination, _boto
from export_ledger.destinations.store import race_problem, racing_creates
from export_ledger.errors import ConfigurationError, ManifestError
from export_ledger.frames import Manifest, TableStream, write_table
from export_ledger.lazy import lazy_module

pa = lazy_module("pyarrow", globals(), "pa")

KEY_COLUMN = "_export_key"
ROW_COLUMN = "_export_row"
#: Commit metadata keys: the revision's manifest, and the export's column names in its own order.
MANIFEST_METADATA = "export_ledger.manifest"
COLUMNS_METADATA = "export_ledger.columns"
#: Rounds of read-check-commit before a table that keeps moving is given up on (each lost round is a commit Delta
#: could not rebase this one over: of the same key, a fence of it, or a change of the table's metadata).
_ROUNDS = 16
#: How many times Delta may rebase one commit over later commits it does not conflict with (other keys' commits:
#: each lost race for the next log entry is one); delta-rs' default is 15, too few for a backfill's many writers.
_REBASES = 100
#: Table settings every table must keep at least as long as the ledger may retry a key (``retention_days``).
RETENTION_SETTINGS = ("delta.setTransactionRetentionDuration", "delta.logRetentionDuration")
#: What VACUUM keeps of files the latest version no longer references (``file_retention_days``).
FILE_RETENTION_SETTING = "delta.deletedFileRetentionDuration"
#: Why the ledger needs each setting, for the refusal of a table that keeps less.
_NEEDED_FOR = {
    "delta.setTransactionRetentionDuration": "a late retry could find no txn and apply twice",
    "delta.logRetentionDuration": "a key's manifest is in its commit's log entry, read whenever the key is verified",
    FILE_RETENTION_SETTING: "a superseded revision is read by time travel until the ledger has recorded the "
    "revision that replaced it",
}
#: The table property that makes Delta refuse any commit removing rows (a restatement's).
APPEND_ONLY = "delta.appendOnly"
_CONSTRAINT = "delta.constraints."
#: What a lost race's ``CommitFailedError`` says after "Failed to commit transaction: " (delta-rs' conflict checker).
_CONFLICTS = (
    "Commit failed: a concurrent", "Concurrent transaction failed", "Metadata changed since last commit",
    "Protocol changed since last commit",
)  # fmt: skip
_INTERVAL_RE = re.compile(r"interval\s+(\d+)\s+(second|minute|hour|day|week)s?", re.IGNORECASE)
_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 604800}
#: Delta's own defaults of the settings when the table does not set them (unset txn retention: never expires).
_DEFAULTS = {"delta.logRetentionDuration": "interval 30 days", FILE_RETENTION_SETTING: "interval 1 week"}
#: ``(endpoint, bucket)`` of the S3 stores whose conditional puts were checked by this process.
_CONDITIONS_CHECKED: set[tuple[str | None, str]] = set()


def _deltalake():
    try:
        import deltalake
    except ImportError:
        raise ConfigurationError(
            "a delta: destination needs the deltalake package: install export-ledger with the delta extra "
            "(pip install 'export-ledger[delta]')"
        ) from None
    return deltalake


def fence_id(logical_key: str) -> str:
    """The app id of a key's fence (its version is the highest token that fenced or committed the key)."""
    return f"{logical_key}#fence"


def revision_id(logical_key: str, revision: int) -> str:
    """The app id whose version is the table version of the commit that published ``revision`` of the key."""
    return f"{logical_key}#r{revision}"


def folder_id(target: ExportTarget) -> str:
    """The app id whose version is the window start (epoch seconds) of the key published at ``target``."""
    return "/".join(target.parts)


def _window_start(logical_key: str) -> int:
    iso = logical_key.rsplit("/", 1)[-1]
    try:
        start = dt.datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:
        raise DestinationError(f"{logical_key!r} does not end with its window start in UTC") from None
    return int(start.timestamp())


def parse_interval(text: str) -> dt.timedelta | None:
    """A Delta interval setting (``interval 30 days``) as a duration; None when it cannot be read."""
    found = _INTERVAL_RE.fullmatch(text.strip())
    if found is None:
        return None
    return dt.timedelta(seconds=int(found.group(1)) * _UNIT_SECONDS[found.group(2).lower()])


def _lost_race(exc: Exception) -> bool:
    """Whether a failed commit lost a race to a commit Delta could not rebase it over (of the same key, a fence of
    it, or a change of the table's metadata or protocol), or past its rebases: read again and judge anew. Any other
    ``CommitFailedError`` (the log entry's write failed, a feature the table needs) is no race, and is not retried."""
    if not isinstance(exc, _deltalake().exceptions.CommitFailedError):
        return False
    reason = str(exc).removeprefix("Failed to commit transaction: ")
    return reason.isdigit() or reason.startswith(_CONFLICTS)  # past its rebases (their count), or a conflict


def _refusal(exc: Exception, table) -> str | None:
    """Why Delta refused a write before any log entry was written, in words naming the table's rule or protocol (never
    a row: the data checker's own message quotes rows); None when the failure is no such refusal.

    * ``Invalid data found``: a CHECK constraint, a column invariant or a generated column's expression failed while
      the rows were being written (delta-rs' data checker), before the commit;
    * ``Unsupported table features required``: the table's protocol needs a writer feature this deltalake lacks, checked
      before anything is written."""
    reason = str(exc)
    if "Invalid data found" in reason:
        return f"its rows break {_rules(table)}"
    if isinstance(exc, _deltalake().exceptions.CommitFailedError) and reason.startswith(
        "Unsupported table features required"
    ):
        protocol = table.protocol()
        features = ", ".join(protocol.writer_features or ()) or "none listed"
        return (
            f"the table needs a writer feature this deltalake cannot write (writer version "
            f"{protocol.min_writer_version}, features: {features})"
        )
    return None


def _append_only(table) -> bool:
    return table.metadata().configuration.get(APPEND_ONLY, "").strip().lower() == "true"


def _rules(table) -> str:
    """The table's own rules on its rows, in words (names and expressions from its metadata, never a row)."""
    configuration = table.metadata().configuration
    rules = [f"CHECK constraint {name.removeprefix(_CONSTRAINT)!r} ({expression})"
             for name, expression in sorted(configuration.items()) if name.startswith(_CONSTRAINT)]  # fmt: skip
    for column in table.schema().fields:
        metadata = column.metadata or {}
        if "delta.invariants" in metadata:
            try:
                expression = json.loads(metadata["delta.invariants"])["expression"]["expression"]
            except (ValueError, KeyError, TypeError):
                expression = "unreadable"
            rules.append(f"the invariant of column {column.name!r} ({expression})")
        if "delta.generationExpression" in metadata:
            rules.append(f"generated column {column.name!r} ({metadata['delta.generationExpression']})")
    if len(rules) == 1:
        return f"the table's {rules[0]}"
    return f"one of the table's rules ({'; '.join(rules)})" if rules else "the table's constraints"


def _serialize(table: pa.Table) -> bytes:
    buffer = io.BytesIO()
    write_table(table, "csv", buffer)
    return buffer.getvalue()


def _data_fields(schema) -> dict:
    """A Delta schema's fields by name, without the destination's own columns."""
    return {f.name: f for f in schema.fields if f.name not in (KEY_COLUMN, ROW_COLUMN)}


def _kind(delta_field) -> str:
    """A Delta field's type in Delta's words (``string``, ``double``, ``timestamp``...)."""
    return getattr(delta_field.type, "type", None) or str(delta_field.type)


def column_changes(table_schema, rows_schema: pa.Schema) -> list[str]:
    """How the rows' columns differ from the table's (by name: the order does not matter), in words naming each column;
    empty when the rows fit, or when the table has no columns of its own yet (made by a fence: the first commit gives
    it the export's). Delta would refuse a missing or added column only with an error quoting rows, and casts a retyped
    one silently."""
    have = _data_fields(table_schema)
    if not have:
        return []
    want = _data_fields(_deltalake().Schema.from_arrow(rows_schema))
    changes = []
    for name, column in have.items():
        if name not in want:
            changes.append(f"column {name!r} ({_kind(column)}) is in the table, not in the export")
        elif _kind(want[name]) != _kind(column):
            changes.append(f"column {name!r} is {_kind(want[name])} in the export, {_kind(column)} in the table")
        elif want[name].nullable and not column.nullable:
            changes.append(f"column {name!r} may be empty in the export, not in the table (NOT NULL)")
    changes += [f"column {name!r} ({_kind(c)}) is in the export, not in the table" for name, c in want.items()
                if name not in have]  # fmt: skip
    return changes


@dataclass(frozen=True)
class DeltaStaged(StagedExport):
    """A revision ready to commit: its rows (the export's columns in its own order, then the key columns), held until
    the commit (nothing of it is in the table yet)."""

    rows: pa.Table = field(default=None, repr=False)


@dataclass(frozen=True)
class _Entry:
    """What one log entry says of the commits of this destination: the txn app ids it carries, and the manifest and
    column order it records (None: none, or unreadable)."""

    version: int
    app_ids: frozenset[str]
    manifest: Manifest | None
    columns: tuple[str, ...] | None


@dataclass(frozen=True)
class DeltaDestination(PointerDestination):
    """Exports as rows of a Delta table, one commit per key and revision (see the module docstring).

    A kind of the publishing contract of its own (:class:`~export_ledger.destinations.pointer.PointerDestination`,
    not the object-store template): its steps (pointer, fence, verify, sweep, stage, commit, unstage) are written on
    the table's log, so the protocol, reconciliation and restatements drive it as they drive a folder or S3; its
    "pointer" is the key's txn versions.

    Attributes:
        table: The table's path or URL (``s3://bucket/prefix/table``); ``{export}`` is replaced by the export's name.
        endpoint_url, region_name, access_key_id, secret_access_key, session_token: S3 settings (None: the AWS
            defaults of the environment).
        conditional_put: ``aws_conditional_put`` for S3 (``etag``: S3's If-None-Match, which Delta's commit needs).
        retention_days: How long the ledger may still retry a key: the table's txn and log retention must be at
            least this long, or a late retry could find no txn and apply twice (and a key's manifest, in its
            commit's log entry, could no longer be read).
        file_retention_days: What ``delta.deletedFileRetentionDuration`` must keep at least (VACUUM's default
            retention): a superseded revision's files, read by time travel until the ledger records the revision
            that replaced it (reconciliation does, within a lease or two). Delta's own default is 7 days.
    """

    table: str
    endpoint_url: str | None = None
    region_name: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    conditional_put: str | None = "etag"
    retention_days: int = 3650
    file_retention_days: int = 7

    pool = "exports-delta"
    locators = ("endpoint_url",)

    # -- spec ----------------------------------------------------------------------------------------------------

    @staticmethod
    def check_spec(spec: str) -> str | None:
        table = spec.removeprefix("delta:")
        if not table or ("://" in table and not table.startswith("s3://")):
            return f"{table!r} is neither a local path nor an s3:// URL"
        return None

    @classmethod
    def from_spec(cls, spec: str, *, ledger_url: str, settings) -> DeltaDestination:
        _deltalake()  # a configured delta: destination without the extra fails here, naming it
        return cls(table=spec.removeprefix("delta:"), **settings)

    def spec(self) -> tuple[str, dict]:
        return f"delta:{self.table}", SCHEME.settings_of(self)

    def describe(self) -> str:
        return f"delta:{self.table}"

    def root_of(self, export: str) -> str:
        """``delta:`` and the table's URL, or its absolute path: a relative one names another table from another
        working directory."""
        table = self.table_for(export)
        if "://" not in table:
            table = str(Path(table).expanduser().resolve())
        return f"delta:{table}"

    def table_for(self, export: str) -> str:
        return self.table.replace("{export}", export)

    def storage_options(self) -> dict[str, str] | None:
        if not self.table.startswith("s3://"):
            return None
        options = {"AWS_REGION": self.region_name}
        if self.conditional_put:
            options["aws_conditional_put"] = self.conditional_put
        if self.endpoint_url:
            options["AWS_ENDPOINT_URL"] = self.endpoint_url
            if self.endpoint_url.startswith("http://"):
                options["AWS_ALLOW_HTTP"] = "true"
        for name, value in (
            ("AWS_ACCESS_KEY_ID", self.access_key_id),
            ("AWS_SECRET_ACCESS_KEY", self.secret_access_key),
            ("AWS_SESSION_TOKEN", self.session_token),
        ):
            if value:
                options[name] = value
        return options

    def location(self, target: ExportTarget) -> str:
        if target.place is None:
            raise DestinationError(f"{folder_id(target)}: revision {target.revision} has no place yet")
        return f"delta:{self.table_for(target.export)}#{folder_id(target)}/{target.place}"

    # -- reading the table ---------------------------------------------------------------------------------------

    def _open(self, export: str, version: int | None = None):
        """The table (at ``version``, or its latest), or None when there is no table yet."""
        deltalake = _deltalake()
        uri = self.table_for(export)
        try:
            table = deltalake.DeltaTable(uri, version=version, storage_options=self.storage_options())
        except deltalake.exceptions.TableNotFoundError:
            return None
        except (OSError, deltalake.exceptions.DeltaError) as exc:
            raise self._unreadable(export, exc) from None
        self._check_retention(uri, table)
        return table

    def _retention_needed(self) -> dict[str, int]:
        """Days each retention setting must keep at least."""
        return {
            **{setting: self.retention_days for setting in RETENTION_SETTINGS},
            FILE_RETENTION_SETTING: self.file_retention_days,
        }

    def _check_retention(self, uri: str, table) -> None:
        """Refuses a table whose txn, log or deleted-file retention is shorter than the ledger needs (see
        :attr:`retention_days` and :attr:`file_retention_days`)."""
        configuration = table.metadata().configuration
        for setting, days in self._retention_needed().items():
            text = configuration.get(setting) or _DEFAULTS.get(setting)
            if text is None:
                continue  # never expires
            kept = parse_interval(text)
            if kept is None or kept < dt.timedelta(days=days):
                raise ConfigurationError(
                    f"{self.describe()}: {setting} is {text!r}, shorter than the {days} days the ledger needs "
                    f"({_NEEDED_FOR[setting]}); set it to at least 'interval {days} days' "
                    "(DeltaTable.alter.set_table_properties)"
                )

    def _create(self, export: str, schema: pa.Schema) -> None:
        """Makes the export's table with the retention the ledger needs; another party's table made meanwhile (the
        create lost a race for version 0) is as good."""
        deltalake = _deltalake()
        try:
            deltalake.DeltaTable.create(
                self.table_for(export), schema, mode="ignore", partition_by=[KEY_COLUMN],
                configuration={s: f"interval {days} days" for s, days in self._retention_needed().items()},
                storage_options=self.storage_options(),
                # Never rebased: a create that lost the race for version 0 would replace the table's metadata.
                commit_properties=deltalake.CommitProperties(max_commit_retries=0),
            )  # fmt: skip
        except (OSError, deltalake.exceptions.DeltaError) as exc:
            if self._open(export) is None:
                raise DestinationError(f"cannot create {self.describe()}: {type(exc).__name__}") from None

    def check_table(self, export: str) -> None:
        """The startup check: refuses a store that ignores conditional puts (:meth:`check_conditions`) and a table
        whose retention is too short (see :attr:`retention_days`)."""
        self.check_conditions(export)
        self._open(export)

    def check_conditions(self, export: str) -> None:
        """Refuses an S3 store that ignores ``If-None-Match: *`` before this destination's first commit to it.

        Every fence and commit relies on Delta's put-if-absent of the next log entry (``aws_conditional_put``): a
        store that accepts a second create lets two racing parties commit the same table version, the later one
        overwriting the earlier. Delta's own API cannot send a bare put-if-absent (a sequential second commit is
        caught by its listing of the log first, so never reaches the store's condition), so a probe object is
        created twice with ``If-None-Match: *`` with the endpoint, region and credentials Delta's storage options
        are made of; the second create must be refused. Then racing creates of another probe object: exactly one may
        win (:func:`~export_ledger.destinations.store.racing_creates` says what that can and cannot show). Local
        paths need no check (a log entry is renamed into place without replacing one).

        The probe is the S3 destination's: its objects are under the table's own folder (``.export-ledger-probe/``,
        which a credential scoped to the table reaches; probes older than an hour by the store's clock, left by a
        killed process, are removed first), one send per request (a lost answer is never resent blind: that makes
        the check fail as unreachable, never judge the store), and the store's errors named as that destination
        names them. Once per process, endpoint and bucket."""
        if not self.table.startswith("s3://"):
            return
        store = self._store(export)
        if (self.endpoint_url, store.bucket) in _CONDITIONS_CHECKED:
            return
        _, _, errors = _boto()
        what = f"check that {store.url('')} honours conditional puts"
        try:
            self._probe(store)
        except errors.ClientError as exc:
            if store._no_bucket(exc):
                raise DestinationError(f"{self.describe()}: {store._missing(what)}") from None
            status = store._status(exc)
            if status is not None and 400 <= status < 500:
                raise DestinationError(
                    f"{self.describe()}: the store refused the {what}: {store._describe_error(exc)}"
                ) from None
            raise DestinationUnreachable(f"{self.describe()}: cannot {what}: {store._describe_error(exc)}") from None
        except errors.BotoCoreError as exc:
            raise DestinationUnreachable(f"{self.describe()}: cannot {what}: {store._describe_error(exc)}") from None
        _CONDITIONS_CHECKED.add((self.endpoint_url, store.bucket))

    def _probe(self, store) -> None:
        """:meth:`check_conditions`' probe on ``store`` (the table's folder), made of the S3 store's own probe hooks
        (:class:`~export_ledger.destinations.store.ProbedStore`): only its creates, which is what Delta's commits
        rely on. Raises the store's own errors."""
        name = store._probe_name()
        try:
            store._conditional_put(name, b"1", None)
            try:
                store._conditional_put(name, b"2", None)
            except store._probe_failures() as exc:
                if not store._refused_condition(exc):
                    raise
            else:
                raise ConfigurationError(
                    f"{self.describe()}: the store accepted a second create of one object (If-None-Match: * "
                    "ignored), so two parties could commit the same Delta table version and overwrite each other. "
                    "Refusing to publish to it; use a store that honours conditional puts"
                )
            accepted = racing_creates(
                lambda body: store._conditional_put(f"{name}-race", body, None), store._refused_condition
            )
            problem = race_problem(accepted, store.read(f"{name}-race"))
            if problem:
                raise ConfigurationError(
                    f"{self.describe()}: the store {problem} (its check and its write are not one atomic step), so "
                    "two parties could commit the same Delta table version and overwrite each other. Refusing to "
                    "publish to it; use a store that honours conditional puts"
                )
        finally:
            for leftover in (name, f"{name}-race"):
                try:
                    store.delete(leftover)
                except DestinationError:
                    pass  # left behind, a probe is swept by a later check once an hour old; the verdict stands

    def _store(self, export: str):
        """The export's table folder as the S3 destination's store (:class:`~export_ledger.destinations.s3.S3Store`):
        its client (one send per request, explicit timeouts), its probe folder and its words for the store's errors."""
        bucket, _, prefix = self.table_for(export).removeprefix("s3://").partition("/")
        return S3Destination(
            bucket=bucket, prefix=prefix.strip("/"), endpoint_url=self.endpoint_url, region_name=self.region_name,
            access_key_id=self.access_key_id, secret_access_key=self.secret_access_key,
            session_token=self.session_token,
        ).store  # fmt: skip

    def _unreadable(self, export: str, exc: Exception) -> DestinationUnreachable:
        """Why the table could not be read: on S3, the store's answer to a listing of the table's log (a missing
        bucket, the HTTP status, an endpoint that does not answer), as the S3 destination words it (deltalake's own
        error says only that it is an ``OSError``); the error's class when the store answers the listing."""
        if self.table.startswith("s3://"):
            store = self._store(export)
            _, _, errors = _boto()
            try:
                store._s3().list_objects_v2(Bucket=store.bucket, Prefix=store._key("_delta_log/"), MaxKeys=1)
            except (errors.ClientError, errors.BotoCoreError) as found:
                return store._unreadable(found, f"read {self.describe()}")
        return DestinationUnreachable(f"cannot read {self.describe()}: {type(exc).__name__}")

    def _key_of(self, table, target: ExportTarget) -> str | None:
        start = table.transaction_version(folder_id(target))
        if start is None:
            return None
        return f"{target.export}/{target.tenant}/{utc_iso(dt.datetime.fromtimestamp(start, dt.UTC))}"

    def _state(self, target: ExportTarget, logical_key: str | None = None):
        """``(table, pointer)``: the table as read (None: no table) and what it says of the key."""
        table = self._open(target.export)
        if table is None:
            return None, Pointer.nothing()
        key = logical_key or self._key_of(table, target)
        if key is None:
            return table, replace(Pointer.nothing(), tag=str(table.version()))
        fence = table.transaction_version(fence_id(key)) or 0
        revision = table.transaction_version(key) or 0
        pointer = Pointer(fence, 0, None, logical_key=key, tag=str(table.version()))
        if revision == 0:
            return table, pointer
        manifest = self._manifest(target.export, key, revision, table)
        if manifest is None:
            return table, replace(pointer, revision=revision, place=f"r{revision}-unknown")
        return table, replace(
            pointer, revision=revision, place=place_name(revision, manifest.fencing_token), sha256=manifest.sha256,
            row_count=manifest.row_count, data_file=manifest.data_file,
        )  # fmt: skip

    def _manifest(self, export: str, key: str, revision: int, table=None) -> Manifest | None:
        entry = self._commit_of(export, key, revision, table)
        return None if entry is None else entry.manifest

    def _commit_of(self, export: str, key: str, revision: int, table=None) -> _Entry | None:
        """The log entry of the commit that published ``revision`` of ``key``: the first entry from the version
        ``K#r<revision>`` names that carries that txn (Delta rebases a commit only over entries that carry none of
        the key's app ids, so no entry before it does). None when no commit of it is in the table, or when its entry
        is gone (the log's cleanup removes entries older than ``delta.logRetentionDuration``, oldest first)."""
        table = table if table is not None else self._open(export)
        start = None if table is None else table.transaction_version(revision_id(key, revision))
        if start is None:
            return None
        table_id = table.metadata().id
        for version in range(start, table.version() + 1):
            entry = self._entry(export, table_id, version)
            if entry is None:
                return None
            if revision_id(key, revision) in entry.app_ids:
                return entry
        return None

    @functools.lru_cache(maxsize=1024)  # noqa: B019 - a committed entry never changes; the destination is frozen
    def _entry(self, export: str, table_id: str, version: int) -> _Entry | None:
        """What log entry ``version`` of the table says, kept for the process's life: keyed by the table's id (its
        ``metaData`` id, made with the table) as well as the path, so that a table dropped and made again at the
        same path is never read through the entries of the one before."""
        actions = self._log_entry(export, version)
        if actions is None:
            return None
        info = next((action["commitInfo"] for action in actions if "commitInfo" in action), {})
        app_ids = frozenset(action["txn"]["appId"] for action in actions if "txn" in action)
        manifest = columns = None
        if MANIFEST_METADATA in info:
            try:
                manifest = Manifest.from_json(info[MANIFEST_METADATA].encode("utf-8"), f"{self.describe()}@v{version}")
            except ManifestError:
                pass  # an unreadable manifest is judged as none (a conflict for whoever expects one)
        try:
            recorded = json.loads(info.get(COLUMNS_METADATA) or "null")
        except json.JSONDecodeError:
            recorded = None  # read in the table's order: a conflict unless that is what was hashed
        if isinstance(recorded, list) and all(isinstance(name, str) for name in recorded):
            columns = tuple(recorded)
        return _Entry(version, app_ids, manifest, columns)

    def _columns(self, export: str, entry: _Entry) -> list[str]:
        """The export's columns in the order its commit recorded (the order its sha256 was taken in)."""
        if entry.columns is not None:
            return list(entry.columns)
        # A commit made before commits recorded their columns: its writer hashed the table's order of the time.
        table = self._open(export, entry.version)
        return list(_data_fields(table.schema()))

    def commit_info(self, export: str, version: int) -> dict | None:
        """The ``commitInfo`` of one log entry (None when the entry is gone)."""
        actions = self._log_entry(export, version)
        return next((action["commitInfo"] for action in actions or () if "commitInfo" in action), None)

    def _log_entry(self, export: str, version: int) -> list[dict] | None:
        """The actions of one log entry, read from the entry itself (``DeltaTable.history`` lists the log past its
        last entry, which moto's server answers only after a timeout); None when the entry is gone."""
        name = f"_delta_log/{version:020d}.json"
        uri = self.table_for(export).rstrip("/")
        try:
            if uri.startswith("s3://"):
                payload = self._store(export).read(name)
            else:
                payload = (Path(uri.removeprefix("file://")) / name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DestinationUnreachable(f"cannot read {self.describe()} version {version}: {exc.strerror}") from None
        if payload is None:
            return None
        return [json.loads(line) for line in payload.splitlines() if line.strip()]

    def pointer(self, target: ExportTarget) -> Pointer:
        return self._state(target)[1]

    def key_at(self, target: ExportTarget) -> str | None:
        pointer = self.pointer(target)
        return pointer.logical_key if pointer.revision else None

    def rows(self, target: ExportTarget, logical_key: str, revision: int) -> pa.Table:
        """The key's rows as revision ``revision`` committed them, in export order, without the key columns: the
        current revision from the table's latest version (whose files VACUUM never removes), a superseded one by time
        travel to its commit; the columns by name, in the order the commit recorded."""
        table = self._open(target.export)
        entry = None if table is None else self._commit_of(target.export, logical_key, revision, table)
        if entry is None:
            raise DestinationError(f"{self.describe()} holds no revision {revision} of {logical_key}")
        current = table.transaction_version(logical_key) == revision
        snapshot = table if current else self._open(target.export, entry.version)
        columns = self._columns(target.export, entry)
        try:
            found = snapshot.to_pyarrow_table(columns=[*columns, ROW_COLUMN], filters=[(KEY_COLUMN, "=", logical_key)])
        except FileNotFoundError:
            if current:
                raise DestinationUnreachable(
                    f"{self.describe()}: files of the table's latest version went missing while {logical_key} was "
                    "read (a VACUUM below the table's retention?); read it again"
                ) from None
            raise DestinationError(
                f"{self.describe()}: revision {revision} of {logical_key} was superseded and its files are gone "
                f"(VACUUM removes a superseded revision's files once {FILE_RETENTION_SETTING} has passed); its "
                "current revision is readable"
            ) from None
        return found.sort_by(ROW_COLUMN).drop_columns([ROW_COLUMN])

    def read_data(self, target: ExportTarget, manifest: Manifest) -> bytes:
        return _serialize(self.rows(target, manifest.logical_key, target.revision))

    def data_format(self, file_format: str) -> str:
        return "csv"  # read_data serializes the key's rows as CSV, whatever the export's file format

    # -- verdicts ------------------------------------------------------------------------------------------------

    def verify(
        self,
        target: ExportTarget,
        *,
        logical_key: str,
        superseded: int,
        expected_sha256: str | None = None,
        pointer: Pointer | None = None,
    ) -> Verification:
        """The key's txn version judged like a pointer: the commit is there or it is not."""
        pointer = pointer or self._state(target, logical_key)[1]
        where = folder_id(target)
        manifest = data_sha256 = None
        if pointer.revision not in (0, superseded) and pointer.place is not None:
            where = self.location(target.at_place(pointer.place))
            if pointer.revision == target.revision:
                key = pointer.logical_key or logical_key
                manifest = self._manifest(target.export, key, pointer.revision)
                if manifest is not None:
                    data_sha256 = hashlib.sha256(self.read_data(target, manifest)).hexdigest()
        verification = judge(
            logical_key=logical_key, revision=target.revision, superseded=superseded,
            pointer_revision=pointer.revision, manifest=manifest, data_sha256=data_sha256, pointer_sha256=None,
            where=where, expected_sha256=expected_sha256,
        )  # fmt: skip
        location = verification.location if verification.verdict is Verdict.PUBLISHED else where
        return replace(verification, fence=pointer.fence, location=location)

    def verify_recorded(self, target: ExportTarget, *, logical_key: str, sha256: str) -> Verification:
        where = self.location(target)
        manifest = self._manifest(target.export, logical_key, target.revision)
        data_sha256 = hashlib.sha256(self.read_data(target, manifest)).hexdigest() if manifest else None
        return judge(
            logical_key=logical_key, revision=target.revision, superseded=-1, pointer_revision=target.revision,
            manifest=manifest, data_sha256=data_sha256, pointer_sha256=None, where=where, expected_sha256=sha256,
        )  # fmt: skip

    # -- publishing ----------------------------------------------------------------------------------------------

    def _fenced(self, target: ExportTarget, pointer: Pointer, token: int) -> Fenced:
        return Fenced(
            f"{self.describe()}: {pointer.logical_key} is fenced at token {pointer.fence}, above this party's "
            f"{token}: a newer party holds the key, and nothing of this one is made visible",
            fence=pointer.fence,
        )

    def fence(self, target: ExportTarget, token: int, *, logical_key: str) -> Pointer:
        """Raises ``K#fence`` to ``token`` with an empty commit, made from the table version read: Delta rebases it
        over other keys' commits, and refuses it over one that carries ``K#fence`` (a fence or commit of this key).
        Nothing is prepared for it (:meth:`prepare_fence`): a commit to the table is durable when acknowledged."""
        deltalake = _deltalake()
        self.check_conditions(target.export)  # no commit goes to a store that ignores If-None-Match
        for _ in range(_ROUNDS):
            table, current = self._state(target, logical_key)
            if current.fence > token:
                raise self._fenced(target, current, token)
            if current.fence == token:
                return current
            if table is None:
                self._create(target.export, pa.schema([(KEY_COLUMN, pa.string()), (ROW_COLUMN, pa.int64())]))
                continue
            transactions = [deltalake.Transaction(fence_id(logical_key), token)]
            if self._key_of(table, target) is None:
                transactions.append(deltalake.Transaction(folder_id(target), _window_start(logical_key)))
            properties = deltalake.CommitProperties(
                max_commit_retries=_REBASES, app_transactions=transactions,
                custom_metadata={"export_ledger.fence": json.dumps({"logical_key": logical_key, "token": token})},
            )  # fmt: skip
            try:
                table.create_write_transaction(
                    [], mode="append", schema=table.schema(), partition_by=[KEY_COLUMN], commit_properties=properties
                )
            except (OSError, deltalake.exceptions.DeltaError) as exc:
                if _lost_race(exc):
                    continue  # a commit of this key (or of the table's metadata) landed since the read: read it again
                refusal = _refusal(exc, table)
                if refusal:
                    raise DestinationError(
                        f"{self.describe()}: Delta refused the fence of {logical_key} before writing it: {refusal}"
                    ) from None
                raise PublishOutcomeUnknown(
                    f"{self.describe()}: the fence's commit failed ({type(exc).__name__})"
                ) from None
            return replace(current, fence=token, logical_key=logical_key)
        raise DestinationError(f"{self.describe()} kept changing while {logical_key} was being fenced")

    def sweep(self, target: ExportTarget, token: int, pointer: Pointer) -> int:
        """Nothing to sweep: a staged revision is never in the table before its commit (the files of a failed
        commit are unreferenced, invisible to readers, and removed by the table's VACUUM)."""
        return 0

    def stage(
        self, target: ExportTarget, token: int, table: pa.Table | TableStream, file_format: str, manifest: Manifest
    ) -> DeltaStaged:
        """The rows, validated (a stream is validated batch by batch, then gathered: one commit holds them all), their
        sha256 (of their CSV serialization in the export's column order, as :meth:`read_data` gives them back) and
        the manifest."""
        if isinstance(table, TableStream):
            tables = list(table)
            table = pa.concat_tables(tables) if tables else table.schema.empty_table()
        for name in (KEY_COLUMN, ROW_COLUMN):
            if name in table.column_names:
                raise DestinationError(f"column {name!r} is reserved by {self.describe()}; nothing was written")
        if "'" in manifest.logical_key:
            raise DestinationError(f"{manifest.logical_key!r} cannot be matched in a predicate; nothing was written")
        sha256 = hashlib.sha256(_serialize(table)).hexdigest()
        complete = replace(manifest, sha256=sha256, row_count=table.num_rows, data_file="delta")
        rows = table.append_column(KEY_COLUMN, pa.array([manifest.logical_key] * table.num_rows, pa.string()))
        rows = rows.append_column(ROW_COLUMN, pa.array(range(table.num_rows), pa.int64()))
        return DeltaStaged(target.at_place(place_name(target.revision, token)), complete, rows)

    def unstage(self, staged: StagedExport) -> None:
        """Nothing to remove: the rows were never written."""

    def commit(self, staged: StagedExport, token: int, *, superseded: int) -> Pointer:
        """The rows and the key's txn actions in one commit, made from the table version at which the fence and the
        key's revision were read (Delta rebases it over other keys' commits only). Idempotent: a key already at this
        place is success. Rows whose columns do not fit the table's, and a restatement of an append-only table, are
        refused before anything is written; so are rows Delta refuses (its constraints) and a table it cannot write."""
        deltalake = _deltalake()
        self.check_conditions(staged.target.export)
        target, manifest = staged.target, staged.manifest
        key = manifest.logical_key
        for _ in range(_ROUNDS):
            table, current = self._state(target, key)
            if current.revision == target.revision and current.place == target.place:
                return current  # an earlier send of this commit landed
            if current.fence > token:
                raise self._fenced(target, current, token)
            if current.revision != superseded:
                raise PointerMoved(
                    f"{self.describe()}: {key} is at revision {current.revision}, not revision {superseded} which "
                    f"revision {target.revision} supersedes; it is not moved",
                    location=self.location(target.at_place(current.place or ".")),
                )
            if table is None:
                self._create(target.export, staged.rows.schema)
                continue
            changes = column_changes(table.schema(), staged.rows.schema)
            if changes:
                raise DestinationError(
                    f"{self.describe()}: {'; '.join(changes)}; nothing of {key} was written (a table's columns "
                    "change only by its owner, with DeltaTable.alter, never by an export)"
                )
            if target.revision > 1 and _append_only(table):
                raise DestinationError(
                    f"{self.describe()} is append-only ({APPEND_ONLY}=true): a restatement replaces the key's rows, "
                    f"which Delta refuses there; nothing of {key} revision {target.revision} was written (restate "
                    f"only once the table's owner sets {APPEND_ONLY} to false)"
                )
            try:
                version = self._write(table, staged, token)
            except (OSError, deltalake.exceptions.DeltaError) as exc:
                if _lost_race(exc):
                    continue  # a commit of this key (or of the table's metadata) landed since the read: read again
                refusal = _refusal(exc, table)
                if refusal:
                    raise DestinationError(
                        f"{self.describe()}: Delta refused the commit of {key} revision {target.revision} before "
                        f"writing it: {refusal}; nothing of it was written"
                    ) from None
                raise PublishOutcomeUnknown(
                    f"{self.describe()}: the commit of {key} revision {target.revision} failed ({type(exc).__name__})",
                    sha256=manifest.sha256, location=self.location(target),
                ) from None  # fmt: skip
            return Pointer(token, target.revision, target.place, manifest.sha256, manifest.row_count,
                           manifest.data_file, key, str(version))  # fmt: skip
        raise DestinationError(f"{self.describe()} kept changing while {key} revision {target.revision} was committed")

    def _write(self, table, staged: DeltaStaged, token: int) -> int:
        """Commits the staged revision from ``table`` (the version read) and returns the table version it landed at."""
        deltalake = _deltalake()
        target, manifest = staged.target, staged.manifest
        key = manifest.logical_key
        transactions = [
            deltalake.Transaction(key, target.revision),
            deltalake.Transaction(fence_id(key), token),
            deltalake.Transaction(revision_id(key, target.revision), table.version() + 1),
        ]
        if self._key_of(table, target) is None:
            transactions.append(deltalake.Transaction(folder_id(target), _window_start(key)))
        properties = deltalake.CommitProperties(
            max_commit_retries=_REBASES, app_transactions=transactions,
            custom_metadata={
                MANIFEST_METADATA: manifest.to_json().decode("utf-8"),
                COLUMNS_METADATA: json.dumps(staged.rows.column_names[:-2]),  # without the two key columns
            },
        )  # fmt: skip
        restating = target.revision > 1
        # A table made by a fence has only the key columns: its first commit gives it the export's (a metadata change,
        # which Delta never rebases anything over); otherwise the columns already fit (column_changes) and are
        # written by name.
        merge = not _data_fields(table.schema())
        deltalake.write_deltalake(
            table, staged.rows, mode="overwrite" if restating else "append", partition_by=[KEY_COLUMN],
            schema_mode="merge" if merge else None, predicate=f"{KEY_COLUMN} = '{key}'" if restating else None,
            commit_properties=properties,
        )  # fmt: skip
        return table.version()  # the table object follows its own commit, rebased or not

    def discard_key(self, target: ExportTarget, token: int, *, logical_key: str, recorded: ExportTarget | None
                    ) -> list[str]:  # fmt: skip
        """Refused, naming the way out: a Delta commit is not taken back by export-ledger (the operator restores the
        table to the version before it, then resolves the key again)."""
        raise DestinationError(_NOT_DISCARDED.format(table=self.describe()))


_NOT_DISCARDED = (
    "{table}: an unrecorded Delta revision is not discarded by export-ledger; restore the table to the version before "
    "its commit (DeltaTable.restore) and resolve the key again"
)


#: A table on S3 reads the S3 destination's variables: its settings are s3.py's, the client timeouts aside (Delta's
#: object store has its own).
SCHEME = Scheme(
    "delta:",
    "DeltaDestination",
    "delta:PATH_OR_URL",
    settings=tuple(s for s in S3_SCHEME.settings if not s.name.endswith("_timeout_seconds")),
)
