"""Creating an Azure Blob container: the one account-level request tieredbuf sends itself.

obstore reads and writes blobs but has no call that creates a container, and a new
storage account (or Azurite, the emulator) has none, so ``tieredbuf create-container``
sends Azure's Create Container request::

    PUT {endpoint}/{container}?restype=container        201 created, 409 it exists

authorised by the account key (Shared Key: an HMAC-SHA256 of the request's canonical
form, as Azure's REST reference specifies it), a SAS token (its query appended), or a
bearer token.  A service principal, the ``az`` CLI's login or a managed identity get a
ConfigError naming ``az storage container create --auth-mode login`` instead.

Failures go through :func:`tieredbuf.store.errmap.classify` like every store request;
an endpoint that does not answer yet (Azurite starting) or a transient failure is
retried with backoff until ``timeout``, then raised saying it gave up.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import http.client
import re
import socket
import time
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Any
from urllib.parse import quote, urlsplit

from tieredbuf.config import RetryConfig
from tieredbuf.errors import ConfigError, TransientStoreError
from tieredbuf.runtime.redact import scrub
from tieredbuf.runtime.retry import backoff_delay, gave_up
from tieredbuf.store.azure import AzureTarget, resolve_azure
from tieredbuf.store.errmap import Facts, classify

API_VERSION = "2021-08-06"
"""x-ms-version of the request (Azurite 3.37 and Azure both serve it)."""
REQUEST_TIMEOUT_S = 10.0
DEFAULT_TIMEOUT = timedelta(seconds=30)
_MESSAGE_RE = re.compile(r"<Message>([^<]{1,300})</Message>")


def create_container(
    url: str, *, timeout: timedelta = DEFAULT_TIMEOUT, **options: Any
) -> tuple[bool, str]:
    """Create the container an Azure ``url`` names (options and the AZURE_* environment
    as :func:`tieredbuf.open` takes them).  Returns (created, where): False when it
    existed already.  Raises the store error after ``timeout`` of transient failures."""
    t = resolve_azure(url, options)
    target, headers = _request(t)
    retry = RetryConfig()
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return _send(target, headers, t), t.where
        except TransientStoreError as e:
            waited = time.monotonic() - start
            delay = backoff_delay(retry, attempt)
            if waited + delay > timeout.total_seconds():
                raise gave_up(e, waited, attempt + 1) from e
            time.sleep(delay)  # backoff before the next attempt
            attempt += 1


def _request(t: AzureTarget) -> tuple[str, dict[str, str]]:
    """The request's URL and headers, authorised by the target's credentials."""
    base = t.where.rstrip("/")
    target = f"{base}/{quote(t.container)}?restype=container"
    date = email.utils.formatdate(usegmt=True)
    headers = {"x-ms-date": date, "x-ms-version": API_VERSION, "Content-Length": "0"}
    key, sas, bearer = (t.given.get(k) for k in ("account_key", "sas_token", "bearer_token"))
    if key is not None:
        headers["Authorization"] = _shared_key(t.account, key, urlsplit(target).path, headers)
    elif sas is not None:
        target += "&" + sas.lstrip("?")
    elif bearer is not None:
        headers["Authorization"] = f"Bearer {bearer}"
    else:
        raise ConfigError(
            f"creating the container {t.container!r} needs an account key, a SAS token or "
            f"a bearer token (AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN, "
            f"AZURE_STORAGE_TOKEN); with a service principal or the az CLI's login use "
            f"az storage container create --name {t.container} --account-name {t.account} "
            f"--auth-mode login"
        )
    return target, headers


def _shared_key(account: str, key: str, path: str, headers: dict[str, str]) -> str:
    """Shared Key for the Blob service: the verb, eleven standard headers (all empty
    here: Content-Length 0 is written empty), the x-ms-* headers sorted, then the
    canonical resource (/account/path, and the query parameters one per line)."""
    ms = "\n".join(f"{k}:{v}" for k, v in sorted(headers.items()) if k.startswith("x-ms-"))
    to_sign = "\n".join(["PUT", *[""] * 11, ms, f"/{account}{path}\nrestype:container"])
    mac = hmac.new(base64.b64decode(key), to_sign.encode(), hashlib.sha256)
    return f"SharedKey {account}:{base64.b64encode(mac.digest()).decode()}"


def _send(target: str, headers: dict[str, str], t: AzureTarget) -> bool:
    # no body (urllib would add a Content-Type to one, which Shared Key signs)
    req = urllib.request.Request(target, method="PUT", headers=headers)
    shown = target.split("?", 1)[0]
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            r.read()
        return True
    except urllib.error.HTTPError as e:
        code = e.headers.get("x-ms-error-code")
        if e.code == 409 and code == "ContainerAlreadyExists":
            return False
        body = e.read().decode("utf-8", "replace")
        m = _MESSAGE_RE.search(body)
        message = (m.group(1).strip().splitlines() or [""])[0] if m else (e.reason or None)
        facts = Facts(status=e.code, code=code, message=message or None, method="PUT", uri=shown)
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, socket.gaierror):
            facts = Facts(connect=True, transport="the host name does not resolve (DNS)")
        elif isinstance(reason, ConnectionRefusedError | ConnectionResetError):
            connect = isinstance(reason, ConnectionRefusedError)
            facts = Facts(connect=connect, transport=str(reason.strerror or reason).lower())
        elif isinstance(reason, TimeoutError | socket.timeout):
            facts = Facts(transport="timed out")
        else:
            facts = Facts(transport=f"{type(reason).__name__}: {reason}")
        facts = Facts(connect=facts.connect, transport=facts.transport, method="PUT", uri=shown)
    raise scrub(
        classify(
            facts, t.container, write=True, bucket=t.container, where=t.where, provider="azure"
        )
    )
