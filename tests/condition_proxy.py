"""Proxies in front of a store that break its conditional create, for the startup checks that must refuse such a
store: one drops ``If-None-Match`` from every request (a store that ignores the header), one checks, then writes
(a store whose create-only-if-absent is not atomic)."""

from __future__ import annotations

import dataclasses
from urllib.parse import parse_qsl, urlencode, urlsplit

from s3_support import FaultProxy


class ConditionStripper(FaultProxy):
    """A :class:`~s3_support.FaultProxy` that forwards every request without its ``If-None-Match`` header."""

    def _forward(self, request, method):
        request.headers = [(k, v) for k, v in request.headers if k.lower() != "if-none-match"]
        return super()._forward(request, method)


class CheckThenWrite(FaultProxy):
    """A :class:`~s3_support.FaultProxy` whose conditional create is two steps: a ``PUT`` with ``If-None-Match: *`` is
    answered 412 when a ``HEAD`` of the same object finds it, else forwarded without the header after
    ``window_seconds`` (a slow gateway in front of a store). Every create sent after another has landed is refused, as
    by an honest store; creates that race inside the window all land.

    The HEAD repeats the PUT's URL (without Azure's ``comp``/``blockid``, so that a Put Block List is checked against
    the blob) and headers: moto checks no signature, and an Azure SAS rides in the query.
    """

    def __init__(self, upstream_url: str, *, window_seconds: float = 0.2, **kwargs) -> None:
        super().__init__(upstream_url, **kwargs)
        self.window_seconds = window_seconds

    def _forward(self, request, method):
        if method != "PUT" or (request.header("If-None-Match") or "").strip() != "*":
            return super()._forward(request, method)
        target = _object_of(request.start_line.split(" ", 2)[1])
        body_headers = ("content-length", "transfer-encoding", "content-md5", "content-type", "if-none-match")
        head = dataclasses.replace(
            request,
            start_line=f"HEAD {target} HTTP/1.1",
            headers=[(k, v) for k, v in request.headers if k.lower() not in body_headers],
            body=b"",
        )
        found = super()._forward(head, "HEAD")
        if found.start_line.split(" ", 2)[1] == "200":
            code = "ConditionNotMet" if request.header("x-ms-version") else "PreconditionFailed"  # Azure's, or S3's
            body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>exists</Message></Error>"
            headers = [("Content-Type", "application/xml"), ("Content-Length", str(len(body))),
                       ("x-ms-error-code", code)]  # fmt: skip
            answer = "HTTP/1.1 412 Precondition Failed"
            return dataclasses.replace(found, start_line=answer, headers=headers, body=body.encode())
        self._stopping.wait(self.window_seconds)
        request.headers = [(k, v) for k, v in request.headers if k.lower() != "if-none-match"]
        return super()._forward(request, method)


def _object_of(target: str) -> str:
    """A request target without the query parameters that name a part of an object rather than the object."""
    parts = urlsplit(target)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in ("comp", "blockid")]
    return parts.path + (f"?{urlencode(query)}" if query else "")
