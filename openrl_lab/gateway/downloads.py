"""Signed download URLs for exported weights (get_external_weights_urls).

The SDK fetches each URL with a plain GET and no API key (its `tinker checkpoint download` uses urllib), so a URL
carries its own proof: an HMAC, under a secret only this server holds, over who asked, which checkpoint, which
export format, which file and until when. It serves that one file to nobody else's benefit: the checkpoint must
still be readable by the user it was signed for (theirs, or published) when it is fetched.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from openrl_lab.home import write_private

DOWNLOAD_PREFIX = "/api/v1/download/"  # open to requests without a key: the URL is the credential
EXPORT_DIR = "export"  # where the kernel writes a checkpoint's exports (train/export.py), read here without torch
URL_TTL_S = 30 * 60  # long enough for a large file; the SDK's CLI asks for new URLs 5 minutes before expiry


class BadDownload(ValueError):
    """A download URL this server did not sign, signed for something else, or expired."""


@dataclass(frozen=True)
class Grant:
    owner: str
    tinker_path: str
    fmt: str
    file: str
    expires: float


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Signer:
    """Signs and checks download tokens with the secret in `<home>/download_key` (made on first use, 0600; kept
    across restarts, so URLs outlive one)."""

    def __init__(self, home: Path):
        path = home / "download_key"
        if not path.exists():
            write_private(path, secrets.token_hex(32))
        self._key = bytes.fromhex(path.read_text().strip())

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self._key, b"openrl-lab-download\0" + payload, hashlib.sha256).digest()

    def sign(self, owner: str, tinker_path: str, fmt: str, file: str, expires: float) -> str:
        payload = json.dumps([owner, tinker_path, fmt, file, int(expires)], separators=(",", ":")).encode()
        return f"{_b64(payload)}.{_b64(self._mac(payload))}"

    def check(self, token: str, file: str, now: float | None = None) -> Grant:
        try:
            payload_text, mac_text = token.split(".")
            payload, mac = _unb64(payload_text), _unb64(mac_text)
        except ValueError:
            raise BadDownload("this download URL is malformed") from None
        if not hmac.compare_digest(mac, self._mac(payload)):
            raise BadDownload("this download URL is not valid: it was altered, or not signed by this server")
        owner, tinker_path, fmt, signed_file, expires = json.loads(payload)
        if signed_file != file:
            raise BadDownload("this download URL is not valid: it was altered, or not signed by this server")
        if (time.time() if now is None else now) >= expires:
            when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires))
            raise BadDownload(
                f"this download URL expired at {when}; ask for new ones (RestClient.get_external_weights_urls)"
            )
        return Grant(owner, tinker_path, fmt, file, expires)
