"""Secrets written where they do not belong: a password with un-encoded characters in a database URL, credentials in
a destination spec, a ledger URL with its password given to ``build_definitions`` as an argument.

Each is either masked (a URL's password, in every message) or refused before it is stored anywhere (a destination
spec that carries a credential; a ledger URL whose password would be shown in the Dagster UI's resource config),
and the refusal never repeats the secret.
"""

from __future__ import annotations

import pytest

from export_ledger import cli
from export_ledger.errors import ConfigurationError, redact_text
from export_ledger.ledger import ExportLedger, LedgerUnavailable, redact_url

# -- 1. a URL's password, whatever characters it holds ---------------------------------------------------------------

#: (URL, how messages show it, pieces of the password that must never show).
PASSWORD_SHAPES = [
    pytest.param(
        "postgresql+psycopg2://exporter:hunter@2-tail@db.internal:5432/ledger",
        "postgresql+psycopg2://exporter:***@db.internal:5432/ledger",
        ["hunter", "2-tail"],
        id="at-sign-in-password",
    ),
    pytest.param(
        "postgresql+psycopg2://exporter:hun:ter2@db.internal:5432/ledger",
        "postgresql+psycopg2://exporter:***@db.internal:5432/ledger",
        ["hun:ter2", "ter2"],
        id="colon-in-password",
    ),
    pytest.param(
        "postgresql+psycopg2://exporter:pa/ss-word@db.internal/ledger",
        "postgresql+psycopg2://exporter:***@db.internal/ledger",
        ["pa/ss", "ss-word"],
        id="slash-in-password",
    ),
    pytest.param(
        "postgresql+psycopg2://exporter:pw@v6-tail@[::1]:5432/ledger",
        "postgresql+psycopg2://exporter:***@[::1]:5432/ledger",
        ["v6-tail"],
        id="ipv6-host",
    ),
    pytest.param(
        "postgresql+psycopg2://exporter@db.internal:5432/ledger",
        "postgresql+psycopg2://exporter@db.internal:5432/ledger",
        [],
        id="no-password",
    ),
]


@pytest.mark.parametrize(("url", "shown", "hidden"), PASSWORD_SHAPES)
def test_a_url_password_is_masked_up_to_the_last_at_sign_before_the_host(url, shown, hidden):
    assert redact_url(url) == shown, "the whole password is masked and the real host is shown"
    assert redact_text(f"cannot reach {url}: refused") == f"cannot reach {shown}: refused", "the same in free text"
    assert redact_text(f"cannot reach {url!r}") == f"cannot reach {shown!r}", "and in a quoted URL"
    for piece in hidden:
        assert piece not in redact_url(url) and piece not in redact_text(url), f"{piece!r} is part of the password"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg2://exporter:hunter@2-tail@127.0.0.1:9/ledger",
        "postgresql+psycopg2://exporter:pw@v6-tail@[::1]:9/ledger",
    ],
)
def test_a_ledger_url_whose_password_holds_an_unencoded_at_sign_is_refused_naming_the_fix(url, capfd):
    with pytest.raises((ConfigurationError, LedgerUnavailable)) as refused:
        ExportLedger(url)
    message = str(refused.value)
    assert "un-encoded '@'" in message and "%40" in message, message
    assert "2-tail" not in message and "v6-tail" not in message, "the password's tail is not shown as the host"

    assert cli.main(["--ledger-url", url, "status"]) == 1
    err = capfd.readouterr().err
    assert "%40" in err and "2-tail" not in err and "v6-tail" not in err and "hunter" not in err, err
