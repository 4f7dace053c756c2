"""A proxy in front of a store that drops ``If-None-Match`` from every request: what a store that ignores the
header looks like to a client (for the startup checks that must refuse such a store)."""

from __future__ import annotations

from s3_support import FaultProxy


class ConditionStripper(FaultProxy):
    """A :class:`~s3_support.FaultProxy` that forwards every request without its ``If-None-Match`` header."""

    def _forward(self, request, method):
        request.headers = [(k, v) for k, v in request.headers if k.lower() != "if-none-match"]
        return super()._forward(request, method)
