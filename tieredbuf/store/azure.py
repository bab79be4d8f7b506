"""Azure Blob Storage: ``az://``, ``abfs[s]://`` and ``https://ACCOUNT.blob.core.windows.net``
URLs, through obstore's AzureStore.

    az://container/prefix                                  account from account_name /
    abfs://container/prefix, abfss://container/prefix      AZURE_STORAGE_ACCOUNT_NAME
    abfss://container@ACCOUNT.dfs.core.windows.net/prefix
    https://ACCOUNT.blob.core.windows.net/container/prefix

Conditional writes are Azure's own: create-if-absent is ``If-None-Match: *`` (a taken
name answers 409 BlobAlreadyExists), replace-if-match is ``If-Match: <ETag>`` (412
ConditionNotMet); the conditional-write probe checks both before the first
conditional write, as on S3.  ADLS Gen2 (``abfs``) accounts are reached through their
Blob endpoint, which serves the same blobs.

Credentials, checked before any request (a store with none would otherwise ask the
instance metadata service, far from the cause): an account key, a SAS token, a bearer
token, a service principal (client id, secret, tenant), workload identity (client id,
tenant, federated token file), the ``az`` CLI's login (``use_azure_cli``), or the
machine's managed identity when asked (``managed_identity=True``).

A process forked after obstore's runtime started cannot use an Azure store (there is
no second client, as botocore is for S3): it raises ForkedError; see
:class:`tieredbuf.store.objstore.ObjStore`.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tieredbuf.config import AZURE_OPTION_ENV, SECRET_OPTIONS
from tieredbuf.errors import ConfigError, MissingCredentialsError
from tieredbuf.runtime import redact
from tieredbuf.store.base import DEFAULT_MANIFEST_WRITES_PER_S
from tieredbuf.store.objstore import ObjStore, Remote
from tieredbuf.store.options import (
    CLIENT_OPTIONS,
    as_bool,
    check_endpoint,
    chunk_size,
    client_options,
    obstore_store,
    retry_options,
    string_options,
    url_prefix,
)
from tieredbuf.store.settings import azure_connection_string, store_options_from_env

AZURE_SCHEMES = ("az", "abfs", "abfss")
AZURE_OPTIONS = frozenset(AZURE_OPTION_ENV) | CLIENT_OPTIONS
"""Keyword options open_store() accepts for Azure URLs."""

_BLOB_HOST = ".blob.core.windows.net"
_DFS_HOST = ".dfs.core.windows.net"
_CONTAINER_RE = re.compile(r"^(?=.{3,63}$)[a-z0-9]+(-[a-z0-9]+)*$")
_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
_OBSTORE_NAMES = {  # our option name -> obstore's AzureConfig key
    "account_name": "account_name",
    "account_key": "account_key",
    "sas_token": "sas_key",
    "bearer_token": "token",
    "client_id": "client_id",
    "client_secret": "client_secret",
    "tenant_id": "tenant_id",
    "federated_token_file": "federated_token_file",
    "endpoint": "endpoint",
}


def is_azure_https(host: str | None) -> bool:
    """True for ``ACCOUNT.blob.core.windows.net`` (or ``.dfs.``): an Azure https URL."""
    return host is not None and host.lower().endswith((_BLOB_HOST, _DFS_HOST))


def is_azure_url(url: str) -> bool:
    """True for a URL open_store() opens as Azure Blob."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        host = parts.hostname
    except ValueError:
        return False
    return scheme in AZURE_SCHEMES or (scheme == "https" and is_azure_https(host))


def _parse(url: str) -> tuple[str, str | None, str]:
    """(container, account or None, path) of an Azure URL."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if scheme == "https":
        account = host.split(".", 1)[0]
        container, _, path = parts.path.lstrip("/").partition("/")
        if not container:
            raise ConfigError(
                f"Azure URL {url!r} names no container: "
                f"https://ACCOUNT.blob.core.windows.net/container/prefix"
            )
        return container, account, path
    if "@" in parts.netloc:  # abfss://container@account.dfs.core.windows.net/prefix
        container = parts.netloc.split("@", 1)[0]
        if not is_azure_https(host):
            raise ConfigError(
                f"Azure URL {url!r} names host {host!r}: use container@ACCOUNT.dfs.core."
                f"windows.net, or {scheme}://container/prefix with the endpoint option"
            )
        return container, host.split(".", 1)[0], parts.path
    if not parts.netloc:
        raise ConfigError(f"Azure URL {url!r} names no container: {scheme}://container/prefix")
    return parts.netloc, None, parts.path


def _check_credentials(url: str, opts: dict[str, Any], cli: bool, managed: bool) -> None:
    """Refuse an Azure URL with no credential source, before any request."""
    if any(opts.get(k) for k in ("account_key", "sas_token", "bearer_token")) or cli or managed:
        return
    principal = [k for k in ("client_id", "client_secret", "tenant_id") if opts.get(k)]
    if len(principal) == 3:
        return
    if opts.get("federated_token_file") and opts.get("client_id") and opts.get("tenant_id"):
        return
    if opts.get("client_secret") or opts.get("federated_token_file"):
        missing = [k for k in ("client_id", "tenant_id") if not opts.get(k)]
        raise MissingCredentialsError(
            f"incomplete Azure service principal for {url}: {', '.join(missing)} not set "
            f"(AZURE_CLIENT_ID, AZURE_TENANT_ID)"
        )
    raise MissingCredentialsError(
        f"no Azure credentials for {url}: set AZURE_STORAGE_ACCOUNT_KEY, "
        f"AZURE_STORAGE_SAS_TOKEN or AZURE_STORAGE_CONNECTION_STRING (or pass account_key= "
        f"/ sas_token=), a service principal "
        f"(AZURE_CLIENT_ID, AZURE_CLIENT_SECRET, AZURE_TENANT_ID), use_azure_cli=True for "
        f"the az CLI's login, or managed_identity=True (TIEREDBUF_AZURE_MANAGED_IDENTITY=1) "
        f"on an Azure VM / AKS"
    )


def _check_key(url: str, key: str | None) -> None:
    """An account key is base64 (obstore would say only "request: failed", at the first
    request)."""
    if key is None:
        return
    try:
        base64.b64decode(key, validate=True)
    except binascii.Error:
        raise ConfigError(
            f"cannot configure Azure store for {url!r}: the account key (account_key, "
            "AZURE_STORAGE_ACCOUNT_KEY) is not base64: "
            "copy it whole from the storage account's Access keys (88 characters, ending "
            "in ==), or use a SAS token (AZURE_STORAGE_SAS_TOKEN)"
        ) from None


@dataclass(frozen=True, slots=True)
class AzureTarget:
    """An Azure URL and its options, resolved and checked (before any request)."""

    container: str
    account: str
    prefix: str
    endpoint: str | None
    """The Blob endpoint given (None: Azure's own, ``https://ACCOUNT.blob.core.windows.net``)."""
    given: dict[str, str]
    """The string options set (our names), the account among them."""
    options: dict[str, Any]
    """Every option, the environment's filled in."""
    cli: bool
    managed: bool

    @property
    def where(self) -> str:
        return self.endpoint or f"https://{self.account}{_BLOB_HOST}"


def resolve_azure(url: str, options: dict[str, Any]) -> AzureTarget:
    """The container, account, endpoint and credentials an Azure URL names with
    ``options`` and the AZURE_* environment; ConfigError (or MissingCredentialsError)
    for anything wrong, before any request."""
    unknown = set(options) - AZURE_OPTIONS
    if unknown:
        raise ConfigError(
            f"unknown option(s) for an Azure store: {', '.join(sorted(unknown))}; "
            f"known: {', '.join(sorted(AZURE_OPTIONS))}"
        )
    container, url_account, path = _parse(url)
    if not _CONTAINER_RE.match(container):
        raise ConfigError(
            f"Azure URL {url!r}: {container!r} is not a container name (3-63 lower-case "
            f"letters, digits and single hyphens)"
        )
    prefix = url_prefix(url, path, "Azure")
    opts = store_options_from_env(options, AZURE_OPTION_ENV)
    redact.register(opts.get("connection_string"))
    from_cs = azure_connection_string(str(opts.pop("connection_string", None) or ""))
    for name, value in from_cs.items():  # what the other options and variables left
        if opts.get(name) is None:
            opts[name] = value
    # from here on, no error, log line or HTTP answer of this process shows them
    redact.register(*(opts.get(k) for k in SECRET_OPTIONS))
    given = string_options(opts, tuple(_OBSTORE_NAMES))
    account = given.get("account_name")
    if from_cs.get("account_name") not in (None, account, url_account):
        raise ConfigError(
            f"the Azure connection string (AZURE_STORAGE_CONNECTION_STRING) is for account "
            f"{from_cs['account_name']!r}, but {url} is opened with account "
            f"{url_account or account!r}: its key would not sign for that account"
        )
    if url_account is not None:
        if account is not None and account != url_account:
            raise ConfigError(
                f"Azure URL {url!r} names account {url_account!r} but account_name is {account!r}"
            )
        account = given["account_name"] = url_account
    if account is None:
        raise ConfigError(
            f"no Azure storage account for {url}: set AZURE_STORAGE_ACCOUNT_NAME (or pass "
            f"account_name=), or use https://ACCOUNT.blob.core.windows.net/container/prefix"
        )
    if not _ACCOUNT_RE.match(account):
        raise ConfigError(
            f"{account!r} is not an Azure storage account name (3-24 lower-case letters and digits)"
        )
    endpoint = given.get("endpoint")
    if endpoint is not None:
        check_endpoint(endpoint, "account_key / sas_token or the AZURE_* environment")
    _check_key(url, given.get("account_key"))
    cli = as_bool("use_azure_cli", opts.get("use_azure_cli", False))
    managed = as_bool("managed_identity", opts.get("managed_identity", False))
    _check_credentials(url, given, cli, managed)
    return AzureTarget(container, account, prefix, endpoint, given, opts, cli, managed)


def open_azure(url: str, options: dict[str, Any]) -> ObjStore:
    """The store for an Azure Blob URL (see the module docstring)."""
    from obstore.store import AzureStore

    t = resolve_azure(url, options)
    config: dict[str, Any] = {_OBSTORE_NAMES[k]: v for k, v in t.given.items()}
    if t.cli:
        config["use_azure_cli"] = True
    client = client_options(t.options, t.endpoint)
    retry = retry_options(t.options)
    size = chunk_size(t.options)
    probe = as_bool("probe", t.options.get("probe", True))
    inner = obstore_store(AzureStore, "Azure", url, t.container, t.prefix, config, client, retry)
    return ObjStore(
        inner,
        url,
        probe_target=(t.where, t.container) if probe else None,
        chunk_size=size,
        remote=Remote("azure", t.container, t.where),
        manifest_writes_per_s=DEFAULT_MANIFEST_WRITES_PER_S,
    )
