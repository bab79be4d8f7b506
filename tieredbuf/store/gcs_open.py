"""``gs://bucket/prefix``: options, credentials and the GCS store built from them.

Credentials, resolved before any request (one line for each misconfiguration):

* ``anonymous=True``: none (a public bucket, an emulator);
* ``credentials_file=``: a service-account key or an authorized-user file;
* ``GOOGLE_APPLICATION_CREDENTIALS``: any credentials file google-auth reads (a
  service-account key, workload identity federation's external-account file, ...);
* ``STORAGE_EMULATOR_HOST`` (as google-cloud-storage and gcsfs honour it): anonymous
  unless ``credentials_file=`` is given;
* ``endpoint=``: the credentials configured (a file, GOOGLE_APPLICATION_CREDENTIALS), else
  anonymous -- never the ambient ones;
* otherwise Application Default Credentials: ``gcloud auth application-default login``,
  or the service account attached to a GCE VM, GKE pod (workload identity), Cloud Run
  or Dataproc node.

The google-cloud-storage client is the ``gcs`` extra (``pip install 'tieredbuf[gcs]'``):
it brings google-auth, google-api-core and protobuf, about 17 MB that S3, Azure and
local users do not need.  This module imports it only for a ``gs://`` URL.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from tieredbuf.errors import ConfigError, MissingCredentialsError
from tieredbuf.store.base import Store
from tieredbuf.store.options import as_bool, as_duration, check_endpoint, url_prefix

GCS_OPTIONS = frozenset(
    {
        "endpoint",
        "credentials_file",
        "anonymous",
        "timeout",
        "connect_timeout",
        "max_retries",
        "retry_timeout",
        "probe",
    }
)
"""Keyword options open_store() accepts for gs:// URLs."""

EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
CREDENTIALS_ENV = "GOOGLE_APPLICATION_CREDENTIALS"
SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_ADC_HELP = (
    "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, run `gcloud auth "
    "application-default login`, or run on GCP with a service account attached; for an "
    "emulator set STORAGE_EMULATOR_HOST (or pass anonymous=True)"
)


def _check_bucket_name(url: str, bucket: str) -> None:
    if not bucket:
        raise ConfigError(f"GCS URL {url!r} names no bucket: gs://bucket/prefix")
    if (
        not _BUCKET_RE.match(bucket)
        or ".." in bucket
        or any(len(part) > 63 for part in bucket.split("."))
        or (len(bucket) > 63 and "." not in bucket)
    ):
        raise ConfigError(
            f"GCS URL {url!r}: {bucket!r} is not a bucket name (3-63 lower-case letters, "
            f"digits, '-', '_' and '.', starting and ending with a letter or digit)"
        )


def _emulator_endpoint(value: str) -> str:
    """STORAGE_EMULATOR_HOST as the clients take it: ``host:port`` means http."""
    return value if "://" in value else f"http://{value}"


def _credentials(
    url: str, path: str | None, anonymous_opt: Any, endpoint: str | None, from_emulator_env: bool
) -> Any:
    """The credentials object for the store, or a one-line error.  ``path``: the
    credentials_file option (None: GOOGLE_APPLICATION_CREDENTIALS, then ADC);
    ``from_emulator_env``: ``endpoint`` is STORAGE_EMULATOR_HOST's."""
    import google.auth
    from google.auth import exceptions as ax
    from google.auth.credentials import AnonymousCredentials

    if anonymous_opt is not None:
        anonymous = as_bool("anonymous", anonymous_opt)
        if anonymous and path is not None:
            raise ConfigError(f"{url}: anonymous=True and credentials_file given: choose one")
    elif from_emulator_env:
        # as google-cloud-storage does with STORAGE_EMULATOR_HOST: no credentials unless
        # given a file (GOOGLE_APPLICATION_CREDENTIALS is not used)
        anonymous = path is None
    else:
        # another endpoint gets the credentials configured for it, never the ambient ones
        # (gcloud's login, the metadata server): none configured, none sent
        anonymous = endpoint is not None and path is None and not os.environ.get(CREDENTIALS_ENV)
    if anonymous:
        return AnonymousCredentials()  # type: ignore[no-untyped-call]
    if path is not None:
        return _from_file(url, path)
    env = os.environ.get(CREDENTIALS_ENV)
    if env and not os.path.isfile(env):
        raise MissingCredentialsError(
            f"no Google Cloud credentials for {url}: {CREDENTIALS_ENV}={env} is not a file"
        )
    try:
        # Application Default Credentials: GOOGLE_APPLICATION_CREDENTIALS (any credentials
        # file google-auth reads), gcloud's login, the attached service account
        creds, _ = google.auth.default(scopes=list(SCOPES))
    except ax.DefaultCredentialsError as e:
        if env:
            raise MissingCredentialsError(
                f"{CREDENTIALS_ENV}={env} for {url} is not a credentials file google-auth "
                f"can use: {_first_line(e)}"
            ) from None
        raise MissingCredentialsError(
            f"no Google Cloud credentials for {url}: {_ADC_HELP}"
        ) from None
    return creds


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _from_file(url: str, path: str) -> Any:
    """A service-account key or an authorized-user file (gcloud's), by its type: the
    loaders google-auth recommends for a file named in configuration."""
    source = f"credentials_file={path}"
    if not os.path.isfile(path):
        raise MissingCredentialsError(
            f"no Google Cloud credentials for {url}: {source} is not a file"
        )
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
        kind = info.get("type") if isinstance(info, dict) else None
        if kind == "service_account":
            from google.oauth2 import service_account

            return service_account.Credentials.from_service_account_info(  # type: ignore[no-untyped-call]
                info, scopes=list(SCOPES)
            )
        if kind == "authorized_user":
            from google.oauth2 import credentials

            return credentials.Credentials.from_authorized_user_info(  # type: ignore[no-untyped-call]
                info, scopes=list(SCOPES)
            )
        why = (
            f"type {kind!r}: credentials_file takes a service-account key or an "
            f"authorized-user file (other kinds through {CREDENTIALS_ENV})"
        )
    except (ValueError, OSError) as e:
        why = _first_line(e)
    raise MissingCredentialsError(
        f"{source} for {url} is not a credentials file google-auth can use: {why}"
    )


def open_gcs(url: str, bucket: str, path: str, options: dict[str, Any]) -> Store:
    """The store for ``gs://bucket/path`` (see the module docstring)."""
    unknown = set(options) - GCS_OPTIONS
    if unknown:
        raise ConfigError(
            f"unknown option(s) for a gs:// store: {', '.join(sorted(unknown))}; "
            f"known: {', '.join(sorted(GCS_OPTIONS))}"
        )
    _check_bucket_name(url, bucket)
    prefix = url_prefix(url, path, "GCS")
    try:
        from tieredbuf.store.gcs import GCSSettings, GCSStore
    except ImportError as e:
        raise ConfigError(
            f"{url}: gs:// needs the gcs extra (pip install 'tieredbuf[gcs]'): "
            f"{e.name or 'google-cloud-storage'} is not installed"
        ) from None
    opts = dict(options)
    endpoint: Any = opts.get("endpoint")
    from_emulator_env = endpoint is None and bool(os.environ.get(EMULATOR_ENV))
    if from_emulator_env:
        endpoint = _emulator_endpoint(os.environ[EMULATOR_ENV])
    if endpoint is not None:
        if not isinstance(endpoint, str):
            raise ConfigError(f"option endpoint must be a string, got {endpoint!r}")
        check_endpoint(endpoint, "a credentials file (GOOGLE_APPLICATION_CREDENTIALS)")
        endpoint = endpoint.rstrip("/")
    file: Any = opts.get("credentials_file")
    if file is not None and not isinstance(file, str | os.PathLike):
        raise ConfigError(f"option credentials_file must be a path, got {file!r}")
    max_retries = opts.get("max_retries", 3)
    if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
        raise ConfigError(f"max_retries must be an int >= 0, got {max_retries!r}")

    def seconds(name: str, default: float) -> float:
        value = opts.get(name)
        return default if value is None else as_duration(name, value).total_seconds()

    timeouts = {
        "connect_timeout": seconds("connect_timeout", 5.0),
        "timeout": seconds("timeout", 60.0),
        "retry_timeout": seconds("retry_timeout", 30.0),
    }
    probe = as_bool("probe", opts.get("probe", True))
    # last: finding Application Default Credentials may ask the metadata server
    credentials = _credentials(
        url,
        os.fspath(file) if file is not None else None,
        opts.get("anonymous"),
        endpoint,
        from_emulator_env,
    )
    settings = GCSSettings(
        bucket=bucket,
        prefix=prefix,
        endpoint=endpoint,
        credentials=credentials,
        max_retries=max_retries,
        **timeouts,
    )
    return GCSStore(settings, url, probe=probe)
