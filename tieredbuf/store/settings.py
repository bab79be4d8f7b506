"""Where a store's settings come from when the caller did not give them: the standard
``AWS_*`` / ``AZURE_*`` environment variables (named in :mod:`tieredbuf.config`) and,
for S3, the shared files ``~/.aws/credentials`` and ``~/.aws/config`` as the aws CLI
and boto3 read them (profiles, ``endpoint_url``, ``services`` sections,
``ignore_configured_endpoint_urls``, botocore's credential chain)."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from tieredbuf.config import S3_CREDENTIAL_ENV, S3_OPTION_ENV
from tieredbuf.errors import ConfigError


def store_options_from_env(
    options: dict[str, Any],
    table: dict[str, tuple[str, ...]] = S3_OPTION_ENV,
) -> dict[str, Any]:
    """Fill options missing from ``options`` from the environment variables ``table``
    names (the standard AWS ones by default); for S3 then from the shared files
    (:func:`profile_options`): the endpoint and region, and credentials when none were
    found.  ``AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true`` ignores every configured
    endpoint (environment and files) but an explicit one, as the aws CLI does."""
    out = dict(options)
    ignore = table is S3_OPTION_ENV and _is_true(os.environ.get(IGNORE_ENDPOINTS_ENV))
    for name, envs in table.items():
        if out.get(name) is not None or (ignore and name == "endpoint"):
            continue
        for env in envs:
            if os.environ.get(env):
                out[name] = os.environ[env]
                break
    if table is not S3_OPTION_ENV:
        return out
    return profile_options(out, explicit_endpoint=options.get("endpoint") is not None)


_TRUE = ("1", "true", "yes", "on")
IGNORE_ENDPOINTS_ENV = "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"


def _is_true(value: object) -> bool:
    return value is True or str(value or "").strip().lower() in _TRUE


def _configured_endpoint(scoped: dict[str, Any], full: dict[str, Any]) -> str | None:
    """The S3 endpoint a profile configures: its ``services`` section's ``s3 =
    endpoint_url``, else its own ``endpoint_url`` (AWS's "service-specific endpoints")."""
    services = scoped.get("services")
    if isinstance(services, str):
        s3 = full.get("services", {}).get(services, {}).get("s3")
        if isinstance(s3, dict) and s3.get("endpoint_url"):
            return str(s3["endpoint_url"])
    url = scoped.get("endpoint_url")
    return str(url) if url else None


def _shared_files() -> list[str]:
    home = os.path.expanduser("~")
    return [
        os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.join(home, ".aws", "credentials"),
        os.environ.get("AWS_CONFIG_FILE") or os.path.join(home, ".aws", "config"),
    ]


def profile_options(options: dict[str, Any], *, explicit_endpoint: bool = False) -> dict[str, Any]:
    """S3 settings from ``~/.aws/credentials`` / ``~/.aws/config`` -- the profile
    ``AWS_PROFILE`` names, else ``default`` -- as the ``aws`` CLI and boto3 read them,
    when a shared file exists or ``AWS_PROFILE`` is set; what ``options`` already hold
    (given, or from the environment) wins.

    * the endpoint: the profile's ``services`` section's ``s3 = endpoint_url``, else its
      ``endpoint_url``; none when it (or the environment) sets
      ``ignore_configured_endpoint_urls = true`` -- then also none from the environment,
      unless the caller gave one (``explicit_endpoint``);
    * the region;
    * credentials, through botocore's credential chain (static keys,
      ``credential_process``, assume-role, SSO), only when ``options`` hold none and no
      other source is chosen (``skip_signature``, ``instance_metadata``, a web identity
      or container role in the environment).  The cloud metadata services are never
      asked here (``instance_metadata`` opts in to them).  Temporary credentials are read
      once, when the store is opened."""
    out = dict(options)
    profile = os.environ.get("AWS_PROFILE") or os.environ.get("AWS_DEFAULT_PROFILE")
    if not profile and not any(os.path.isfile(f) for f in _shared_files()):
        return out
    want_creds = not (
        out.get("access_key_id") is not None
        or out.get("secret_access_key") is not None
        or any(_is_true(out.get(k)) for k in ("skip_signature", "instance_metadata"))
        or any(os.environ.get(name) for name in S3_CREDENTIAL_ENV)
    )
    import botocore.session
    from botocore.exceptions import BotoCoreError, ProfileNotFound

    where = f"profile {profile!r}" if profile else "the default profile"
    try:
        session = botocore.session.Session(profile=profile)
        scoped = session.get_scoped_config()
        endpoint = _configured_endpoint(scoped, session.full_config)
        region = session.get_config_variable("region")
        creds = None
        if want_creds:
            resolver = session.get_component("credential_provider")
            for method in ("env", "container-role", "iam-role"):  # env: read above
                resolver.remove(method)
            creds = resolver.load_credentials()
    except ProfileNotFound:
        raise ConfigError(
            f"AWS_PROFILE names {where}, which is in neither {' nor '.join(_shared_files())}"
        ) from None
    except BotoCoreError as e:
        raise ConfigError(f"cannot read S3 settings of {where} in ~/.aws: {e}") from None
    ignore = os.environ.get(IGNORE_ENDPOINTS_ENV) or scoped.get("ignore_configured_endpoint_urls")
    if _is_true(ignore):
        if not explicit_endpoint:
            out.pop("endpoint", None)
    elif out.get("endpoint") is None and endpoint:
        out["endpoint"] = endpoint
    if out.get("region") is None and region:
        out["region"] = region
    if creds is None:
        return out
    frozen = creds.get_frozen_credentials()
    out["access_key_id"], out["secret_access_key"] = frozen.access_key, frozen.secret_key
    if frozen.token:
        out["session_token"] = frozen.token
    return out


AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (  # Azurite's well-known development key (public: Azurite's README)
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
_CONNECTION_KEYS = {  # a connection string's setting -> our option
    "accountname": "account_name",
    "accountkey": "account_key",
    "sharedaccesssignature": "sas_token",
    "blobendpoint": "endpoint",
}


def azure_connection_string(text: str) -> dict[str, str]:
    """The ``az://`` options an Azure Storage connection string sets (as the Azure SDKs
    read ``AZURE_STORAGE_CONNECTION_STRING``): ``AccountName``, ``AccountKey``,
    ``SharedAccessSignature`` and ``BlobEndpoint``; without a ``BlobEndpoint``, one from
    ``DefaultEndpointsProtocol`` and ``EndpointSuffix`` when either is not Azure's own;
    ``UseDevelopmentStorage=true`` is Azurite's development account on 127.0.0.1:10000.
    Setting names are case-insensitive; the queue, table and file endpoints are not
    used.  ConfigError for a part without ``=``, never showing a value."""
    parts: dict[str, str] = {}
    for i, part in enumerate(p.strip() for p in text.split(";")):
        if not part:
            continue
        name, eq, value = part.partition("=")
        if not eq or not name.strip():
            raise ConfigError(
                f"the Azure connection string (AZURE_STORAGE_CONNECTION_STRING) has a part "
                f"without a setting name and '=' (part {i + 1}); it reads "
                f"'DefaultEndpointsProtocol=https;AccountName=...;AccountKey=...'"
            )
        parts[name.strip().lower()] = value.strip()
    if _is_true(parts.get("usedevelopmentstorage")):
        return {
            "account_name": AZURITE_ACCOUNT,
            "account_key": AZURITE_KEY,
            "endpoint": f"http://127.0.0.1:10000/{AZURITE_ACCOUNT}",
        }
    out = {opt: parts[k] for k, opt in _CONNECTION_KEYS.items() if parts.get(k)}
    protocol = parts.get("defaultendpointsprotocol", "https").lower()
    suffix = parts.get("endpointsuffix", "core.windows.net")
    account = out.get("account_name")
    if "endpoint" not in out and account and (protocol, suffix) != ("https", "core.windows.net"):
        out["endpoint"] = f"{protocol}://{account}.blob.{suffix}"
    if "account_name" not in out and "endpoint" in out:
        host = urlsplit(out["endpoint"]).hostname or ""
        if host.endswith(".blob." + suffix):  # https://ACCOUNT.blob.core.windows.net
            out["account_name"] = host.split(".", 1)[0]
    return out
