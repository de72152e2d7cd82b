"""Hugging Face Hub failures as one-line errors, shared by ``hub_download`` and ``hub_upload``.

A client or network exception becomes a ``(what, fix)`` pair; :func:`hub_error` turns it into a
``PipelineError`` on one line with the token masked. The token never reaches a message: the known
token and anything after ``Bearer`` are replaced by ``<token>``, whatever the server sent back.
Nothing here imports ``huggingface_hub`` at module level (callers import it lazily).
"""

from __future__ import annotations

import re

from recurrent_coreai.util import env
from recurrent_coreai.util.errors import PipelineError

_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+")  # RFC 6750 token characters


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0].strip()[:300] if text else type(exc).__name__


def client_token() -> str | None:
    """The token huggingface_hub sends (HF_TOKEN, or the one stored by ``hf auth login``)."""
    try:
        from huggingface_hub import get_token

        return get_token() or None
    except Exception:  # noqa: BLE001 - only used to mask the token; fall back to the environment
        return env.hub_token()


def scrub(value, token: str | None):
    """``value`` (a string, or a list of them) with the token and any ``Bearer <credential>`` masked."""
    if isinstance(value, list):
        return [scrub(v, token) for v in value]
    if not isinstance(value, str):
        return value
    if token and isinstance(token, str) and len(token) >= 4:
        value = value.replace(token, "<token>")
    return _BEARER.sub(r"\1<token>", value)


def hub_error(where, what: str, fix: str, token: str | None) -> PipelineError:
    """A ``PipelineError`` whose three parts are single lines with the token masked."""
    def clean(text) -> str:
        return scrub(" ".join(str(text).split()), token)

    return PipelineError(clean(where), clean(what), clean(fix))


def http_status(exc: BaseException) -> int | None:
    return getattr(getattr(exc, "response", None), "status_code", None)


def http_detail(exc: BaseException) -> str:
    """``HTTP 403: <what the server said>`` for an HTTP error, else ``<Type>: <first line>``."""
    status = http_status(exc)
    if status is None:
        return f"{type(exc).__name__}: {first_line(exc)}"
    said = " ".join(str(getattr(exc, "server_message", None) or "").split())[:300]
    return f"HTTP {status}" + (f": {said}" if said else "")


def root_cause(exc: BaseException) -> BaseException:
    """What a ``LocalEntryNotFoundError`` ("could not reach the Hub, not in the cache") wraps, if anything:
    huggingface_hub hides a 403, a timeout or offline mode behind it."""
    from huggingface_hub import errors as hf_errors

    while isinstance(exc, hf_errors.LocalEntryNotFoundError) and exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def common_failure(exc: BaseException, access: str) -> tuple[str, str] | None:
    """(what, fix) for failures that read the same in both directions — the token was refused,
    offline mode is on — or None. ``access``: ``read`` or ``write``."""
    from huggingface_hub import constants
    from huggingface_hub import errors as hf_errors

    if http_status(exc) in (401, 403):
        return (f"authentication failed ({http_detail(exc)})",
                f"check that HF_TOKEN holds a valid token with {access} access to the repo")
    if isinstance(exc, hf_errors.OfflineModeIsEnabled) or constants.is_offline_mode():
        what = "HF_HUB_OFFLINE is set, so the Hub is not contacted"
        if access == "read":
            return (f"{what}, and the snapshot is not (completely) in the Hugging Face cache",
                    "unset HF_HUB_OFFLINE (or fill the cache once with network access)")
        return f"{what}: uploading needs the network", "unset HF_HUB_OFFLINE to publish"
    return None
