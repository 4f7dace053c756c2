"""From a destination spec (``EXPORTS_DESTINATION``, ``ExportSpec.destination``) to a destination, through the schemes
each destination module declares: a new store is one file under ``export_ledger/destinations/`` with a ``SCHEME``.

A module declares ``SCHEME = Scheme(...)``: the spec's prefix (``s3://``; ``""`` for a plain folder path), its
destination class (which builds itself with ``from_spec`` and checks a spec with ``check_spec``), an example spec, and
the settings it takes (:class:`Setting`: each with the environment variable it is read from, whether it is a secret,
how its text is parsed and its default). The Dagster resource holds a destination's settings by name, secrets as
``EnvVar`` s of their declared variables, so a new store needs no code outside its own module.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from export_ledger.errors import ConfigurationError, userinfo_end
from export_ledger.ledger.urls import may_hold_secret

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
#: How a parser reads in a message about a bad value.
_PARSED_AS = {"float": "a number", "int": "an integer"}


@dataclass(frozen=True)
class Setting:
    """One setting a destination takes, as its scheme declares it.

    Attributes:
        name: The destination's attribute, and the setting's key in ``DestinationResource.settings``.
        env: The environment variables it is read from, the first one set winning (a str: one variable); ``()``
            for a setting given only in code or resource config.
        secret: A secret whatever its value (a key, a token): it reaches Dagster by name, as ``EnvVar`` of the one
            of its variables that holds it, never as a value, so it needs one. A setting named ``*_url`` is also a
            secret when its value carries a password, a user part (a token: ``https://t0ken@host``) or a query.
        credential: It holds or names a credential (a key id, an account, a key file; every secret does): a spec
            refused for carrying a credential names its variable as the place to put one.
        parse: How its text (from the environment or resource config) becomes its value: ``str``, ``float``.
        default: Its value when nothing gives one (None: the destination's own lookup, such as boto3's).
        doc: One line on what it is.

    Example:
        >>> Setting("api_token", "STORE_API_TOKEN", secret=True, doc="The store's API token")  # doctest: +SKIP
    """

    name: str
    env: tuple[str, ...] | str = ()
    secret: bool = False
    credential: bool = False
    parse: Callable[[str], object] = str
    default: object = None
    doc: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.env, str):
            object.__setattr__(self, "env", (self.env,))
        if self.secret and not self.env:
            raise ValueError(f"the secret setting {self.name!r} needs an environment variable: it is passed by name")
        object.__setattr__(self, "credential", self.credential or self.secret)

    @property
    def variable(self) -> str | None:
        """The variable it is named by in messages, and passed to Dagster as (``EnvVar``) when no other is set."""
        return self.env[0] if self.env else None

    def read(self, environ: Mapping[str, str]) -> tuple[str, str] | None:
        """``(variable, text)`` of the first of its variables that ``environ`` sets (to anything but ""), or None."""
        for variable in self.env:
            if environ.get(variable):
                return variable, environ[variable]
        return None

    def value(self, given: object, *, what: str, source: str | None = None) -> object:
        """``given`` parsed when it is text, as it is otherwise (a value from code).

        Raises:
            ConfigurationError: naming ``what``, the setting, ``source`` (the variable it was read from) and what
                it must be; the value only when it cannot hold a secret (the setting is no secret and no ``*_url``,
                and the value is no URL with a user part, a password or a query).
        """
        if not isinstance(given, str):
            return given
        try:
            return self.parse(given)
        except (TypeError, ValueError):
            name = getattr(self.parse, "__name__", "")
            hidden = self.secret or self.name.endswith("_url") or may_hold_secret(given)
            shown = "" if hidden else f", got {given!r}"
            where = f" ({source})" if source else ""
            raise ConfigurationError(
                f"{what}: setting {self.name}{where} must be {_PARSED_AS.get(name, f'a valid {name}')}{shown}"
            ) from None


@dataclass(frozen=True)
class Scheme:
    """One kind of destination, as its module declares it.

    Attributes:
        prefix: What a spec of this kind starts with (``""``: a local folder path, the default).
        destination: The destination class's name in the declaring module.
        example: A spec of this kind, for messages.
        settings: The settings the destination takes (:class:`Setting`), by which its spec builds it.
        module: The declaring module (filled in by :func:`schemes`).
    """

    prefix: str
    destination: str
    example: str
    settings: tuple[Setting, ...] = ()
    module: str = ""

    def load(self):
        return getattr(importlib.import_module(self.module), self.destination)

    def setting(self, name: str) -> Setting | None:
        return next((setting for setting in self.settings if setting.name == name), None)

    def refuse_undeclared(self, names: Iterable[str], what: str = "destination") -> None:
        """Refuses setting names this scheme does not declare.

        Raises:
            ConfigurationError: naming ``what``, the undeclared names and the scheme's settings.
        """
        unknown = sorted(set(names) - {setting.name for setting in self.settings})
        if unknown:
            known = ", ".join(setting.name for setting in self.settings)
            raise ConfigurationError(
                f"{what}: {self.example} takes no setting {', '.join(map(repr, unknown))}; "
                + (f"its settings are {known}" if known else "it takes no settings")
            )

    def settings_of(self, destination: object) -> dict[str, object]:
        """A destination's values of this scheme's settings, by name (what its ``spec()`` returns)."""
        return {setting.name: getattr(destination, setting.name) for setting in self.settings}

    def values(
        self,
        given: Mapping[str, object] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        what: str = "destination",
    ) -> dict[str, object]:
        """Every setting's value: ``given`` (by setting name), else read from ``environ`` (by variable), else its
        default. Text is parsed by the setting's declaration; a None or "" in ``given`` gives nothing.

        Raises:
            ConfigurationError: ``given`` names a setting this scheme does not declare (named, with those it does),
                or a value does not parse (the setting named).
        """
        self.refuse_undeclared(given or {}, what)
        values = {}
        for setting in self.settings:
            found = setting.read(environ) if environ is not None else None
            value = (given or {}).get(setting.name)
            if value is not None and value != "":
                values[setting.name] = setting.value(value, what=what)
            elif found is not None:
                values[setting.name] = setting.value(found[1], what=what, source=found[0])
            else:
                values[setting.name] = setting.default
        return values


@functools.cache
def schemes() -> tuple[Scheme, ...]:
    """Every scheme the destination modules declare, the longest prefix first (the folder path last)."""
    import export_ledger.destinations as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        scheme = getattr(module, "SCHEME", None)
        if isinstance(scheme, Scheme):
            found.append(replace(scheme, module=module.__name__))
    return tuple(sorted(found, key=lambda s: -len(s.prefix)))


def scheme_of(spec: str) -> Scheme:
    for scheme in schemes():
        if spec.startswith(scheme.prefix):
            return scheme
    raise ConfigurationError(f"no destination takes {spec!r}")  # the folder path (prefix "") takes everything


def scheme_taking(spec: str, what: str = "destination") -> Scheme:
    """The scheme whose destination takes ``spec`` (a folder path's, for anything no other prefix matches).

    Raises:
        ConfigurationError: ``spec`` is a URL of a scheme no destination takes (``ftp://``), naming those there are.
    """
    scheme = scheme_of(spec)
    if not scheme.prefix and ("://" in spec or spec.split(":", 1)[0] in _URL_SCHEMES):
        raise ConfigurationError(f"{what} scheme {spec.split(':', 1)[0]!r} is not supported; use {kinds()}")
    return scheme


def kinds() -> str:
    """The kinds of spec, for messages: ``a folder path, s3://bucket/prefix or ledger-table:<table>``."""
    examples = [s.example for s in schemes()]
    return ", ".join(examples[:-1]) + f" or {examples[-1]}" if len(examples) > 1 else examples[0]


def destination_from(
    spec: str,
    *,
    ledger_url: str,
    settings: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    what: str = "destination",
):
    """Builds a destination from its spec and the settings its scheme declares.

    Args:
        spec: The spec.
        ledger_url: The ledger's URL (a ``ledger-table:`` destination lives in the ledger's database).
        settings: Settings given by name (a ``DestinationResource``'s, code's): each must be one the spec's scheme
            declares; text is parsed by its declaration, and None or "" gives nothing.
        environ: An environment (``os.environ``; the CLI's): the scheme's own settings are read from their declared
            variables there, and every other variable is none of the destination's business. ``settings`` wins.
        what: The setting's name in error messages.

    Raises:
        ConfigurationError: naming the setting and what is wrong with it, or a setting the scheme does not declare.

    Example:
        >>> destination_from("s3://bucket/exports", ledger_url="", environ=os.environ)  # doctest: +SKIP
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigurationError(f"{what} must be {kinds()}")
    refuse_credentials(spec, what)
    scheme = scheme_taking(spec, what)
    cls = scheme.load()
    problem = cls.check_spec(spec)
    if problem:
        raise ConfigurationError(f"{what} {spec!r}: {problem}")
    values = scheme.values(settings, environ=environ, what=what)
    return cls.from_spec(spec, ledger_url=ledger_url, settings=values)


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
    """Where the credentials go instead: the variables of the credential settings the scheme declares (every
    scheme's, for a URL no destination takes)."""
    taking = [scheme] if scheme.settings or not url_like else [s for s in schemes() if s.settings]
    names = list(dict.fromkeys(s.variable for each in taking for s in each.settings if s.credential and s.variable))
    if not names:
        return f"{scheme.example} takes no credentials: write it without one"
    written = scheme.example if scheme.settings else f"one of {kinds()}"
    return (
        f"write it as {written} and give the credentials in the environment ({', '.join(names)}), which the code "
        "location passes to Dagster by name (EnvVar), never by value"
    )
