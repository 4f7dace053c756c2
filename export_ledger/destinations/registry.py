"""From a destination spec (``EXPORTS_DESTINATION``, ``ExportSpec.destination``) to a destination, through the schemes
each destination module declares: a new store is one file under ``export_ledger/destinations/`` with a ``SCHEME``.

A module declares ``SCHEME = Scheme(...)``: the spec's prefix (``s3://``; ``""`` for a plain folder path), its
destination class (which builds itself with ``from_spec`` and checks a spec with ``check_spec``), the Dagster pool kind
its exports run in, and the credential settings it takes (passed as Dagster ``EnvVar`` s, never values).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from collections.abc import Mapping
from dataclasses import dataclass

from export_ledger.errors import ConfigurationError, userinfo_end

#: Spec prefixes that look like a URL: a folder path never starts with one.
_URL_SCHEMES = ("s3", "gs", "az", "abfs", "ftp", "http", "https", "delta", "file")
#: The keys of an Azure Storage connection string (``DefaultEndpointsProtocol=https;AccountName=..;AccountKey=..``).
_CONNECTION_STRING_KEY = re.compile(
    r"(?:^|;)\s*(DefaultEndpointsProtocol|AccountName|AccountKey|SharedAccessSignature|BlobEndpoint|EndpointSuffix"
    r"|SharedAccessKeyName|SharedAccessKey)\s*=",
    re.IGNORECASE,
)
#: A query parameter that carries a credential: a presigned URL's (``X-Amz-Signature``, ``X-Goog-Signature``), a SAS
#: token's (``sv``, ``sig``), or anything named like a secret.
_CREDENTIAL_PARAMETER = re.compile(
    r"(?:^|[?&;])(?:x-(?:amz|goog)-[\w-]+|sv|se|sp|sr|[\w.-]*(?:pass|secret|token|key|sig|credential)[\w.-]*)=",
    re.IGNORECASE,
)
#: ``user:password@host`` written as a folder path (scp's ``user:password@host:/path``, the password may hold a ``/``
#: when a host follows as ``host:``); a drive's ``C:\`` is not.
_LOCAL_USERINFO = re.compile(r"^[^/\\:@]+:(?:[^/\\]*@|.*@[^/\\:@]+:)")
#: A SAS token's signature (``sig=``), the part of a bare SAS token (``sv=..&sig=..``, no ``?``) that is the secret.
_SAS_SIGNATURE = re.compile(r"(?:^|[?&;])sig=", re.IGNORECASE)
#: The settings of a scheme that hold or name credentials (``DestinationResource`` fields).
_CREDENTIAL_SETTING = re.compile(r"key|secret|token|credential|account_name")


@dataclass(frozen=True)
class Scheme:
    """One kind of destination, as its module declares it.

    Attributes:
        prefix: What a spec of this kind starts with (``""``: a local folder path, the default).
        destination: The destination class's name in the declaring module.
        example: A spec of this kind, for messages.
        credentials: The credential settings the destination takes (names of ``DestinationResource`` fields).
    """

    prefix: str
    destination: str
    example: str
    credentials: tuple[str, ...] = ()
    module: str = ""

    def load(self):
        return getattr(importlib.import_module(self.module), self.destination)


@functools.cache
def schemes() -> tuple[Scheme, ...]:
    """Every scheme the destination modules declare, the longest prefix first (the folder path last)."""
    import export_ledger.destinations as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        scheme = getattr(module, "SCHEME", None)
        if isinstance(scheme, Scheme):
            found.append(Scheme(scheme.prefix, scheme.destination, scheme.example, scheme.credentials, module.__name__))
    return tuple(sorted(found, key=lambda s: -len(s.prefix)))


def scheme_of(spec: str) -> Scheme:
    for scheme in schemes():
        if spec.startswith(scheme.prefix):
            return scheme
    raise ConfigurationError(f"no destination takes {spec!r}")  # the folder path (prefix "") takes everything


def kinds() -> str:
    """The kinds of spec, for messages: ``a folder path, s3://bucket/prefix or ledger-table:<table>``."""
    examples = [s.example for s in schemes()]
    return ", ".join(examples[:-1]) + f" or {examples[-1]}" if len(examples) > 1 else examples[0]


def destination_from(
    spec: str,
    *,
    ledger_url: str,
    credentials: Mapping[str, object] | None = None,
    what: str = "destination",
):
    """Builds a destination from its spec.

    Args:
        spec: The spec.
        ledger_url: The ledger's URL (a ``ledger-table:`` destination lives in the ledger's database).
        credentials: Settings for the destination's kind (for S3: ``endpoint_url``, ``region_name``,
            ``access_key_id``, ...); None values are left to the destination's own lookup.
        what: The setting's name in error messages.

    Raises:
        ConfigurationError: naming the setting and what is wrong with it.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigurationError(f"{what} must be {kinds()}")
    refuse_credentials(spec, what)
    scheme = scheme_of(spec)
    if not scheme.prefix and ("://" in spec or spec.split(":", 1)[0] in _URL_SCHEMES):
        raise ConfigurationError(f"{what} scheme {spec.split(':', 1)[0]!r} is not supported; use {kinds()}")
    cls = scheme.load()
    problem = cls.check_spec(spec)
    if problem:
        raise ConfigurationError(f"{what} {spec!r}: {problem}")
    given = {k: v for k, v in (credentials or {}).items() if v is not None and k in scheme.credentials}
    return cls.from_spec(spec, ledger_url=ledger_url, credentials=given)


def refuse_credentials(spec: str, what: str = "destination") -> None:
    """Refuses a destination spec that carries a credential, without repeating it.

    A spec is stored and shown: in the ledger (every key's location), in run output and ``status --json``, in the
    Dagster UI's resource config. So it never holds a credential: not a ``user:password@`` (``s3://KEY:SECRET@bucket``),
    not a query string on an object-store spec (a presigned URL's ``?X-Amz-Signature=``, a SAS token's
    ``?sv=..&sig=``), not an Azure connection string given as the destination (it would be a local folder named with
    its AccountKey). The message names the setting, shows the spec with the secret part replaced by ``***`` and says
    where the credentials go instead: the destination's own settings (``AWS_SECRET_ACCESS_KEY``, ...), passed as
    Dagster ``EnvVar`` s.

    Raises:
        ConfigurationError: naming ``what``, the kind of credential, the spec as shown and the settings to use.
    """
    found = _credential_in(spec)
    if found is None:
        return
    problem, shown, scheme = found
    raise ConfigurationError(
        f"{what} carries {problem}: {shown!r}. A destination spec is stored and shown (the ledger, run output, the "
        f"Dagster UI), so it never holds a credential; {_where_credentials_go(scheme, url_like='://' in spec)}"
    )


def holds_credential(spec: str) -> bool:
    """Whether a destination spec carries a credential (what :func:`refuse_credentials` refuses)."""
    return _credential_in(spec) is not None


def _credential_in(spec: str) -> tuple[str, str, Scheme] | None:
    """``(what the spec carries, the spec with it masked, the scheme whose settings take it)``, or None."""
    if _CONNECTION_STRING_KEY.search(spec):
        keys = [match.group(1) for match in _CONNECTION_STRING_KEY.finditer(spec)]
        shown = ";".join(f"{key}=***" for key in keys)
        return "an Azure Storage connection string (its key or signature is a secret)", shown, scheme_of("az://")
    scheme = scheme_of(spec)
    head, separator, rest = spec.partition("://")
    if separator:
        problems, end = [], userinfo_end(rest)
        authority = rest.split("/", 1)[0]
        if end >= 0 and ("@" in authority or ":" in authority):  # a bucket or container name holds neither
            problems.append("a user name and password (user:password@)")
            rest = "***" + rest[end:]
        if "?" in rest:
            problems.append("a query string (a presigned URL's signature or a SAS token goes there)")
            rest = rest.split("?", 1)[0] + "?***"
        return (" and ".join(problems), f"{head}://{rest}", scheme) if problems else None
    if _LOCAL_USERINFO.match(spec):
        return "a user name and password (user:password@)", "***" + spec[spec.rfind("@") :], scheme
    if "?" in spec and _CREDENTIAL_PARAMETER.search(spec[spec.index("?") :]):
        return "a query string with a credential", spec.split("?", 1)[0] + "?***", scheme
    if "?" not in spec and _SAS_SIGNATURE.search(spec):  # a SAS token pasted without its URL: no "?" before it
        return "an Azure SAS token (its sig= is a secret)", "***", scheme_of("az://")
    parameter = _CREDENTIAL_PARAMETER.search(spec) if "?" not in spec and "&" in spec else None
    if parameter:  # parameters joined by "&" with no "?": a query string pasted without its URL
        cut = parameter.start() + (spec[parameter.start()] in "&;")
        return "a query string with a credential", spec[:cut] + "***", scheme
    return None


def _where_credentials_go(scheme: Scheme, *, url_like: bool) -> str:
    """Where the credentials go instead: the environment variables of export_ledger.settings that the scheme's
    destination reads (every object store's, for a URL no destination takes)."""
    from export_ledger.settings import CLOUD_ENV, S3_ENV

    by_setting = {**S3_ENV, **CLOUD_ENV}
    taking = [scheme] if scheme.credentials or not url_like else [s for s in schemes() if s.credentials]
    settings = [name for s in taking for name in s.credentials if _CREDENTIAL_SETTING.search(name)]
    names = list(dict.fromkeys(by_setting[name] for name in settings if name in by_setting))
    if not names:
        return f"{scheme.example} takes no credentials: write it without one"
    written = scheme.example if scheme.credentials else f"one of {kinds()}"
    return (
        f"write it as {written} and give the credentials in the environment ({', '.join(names)}), which the code "
        "location passes to Dagster by name (EnvVar), never by value"
    )
