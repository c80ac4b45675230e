"""Standard Webhooks signatures (https://www.standardwebhooks.com).

The receiver recomputes HMAC-SHA256 over "{webhook-id}.{webhook-timestamp}.{body}" with the
shared secret and compares it to ``webhook-signature`` ("v1,<base64>"). Secrets are
``whsec_<base64>``; the key is the base64-decoded part (the reference ``standardwebhooks``
package decodes it the same way, which tests/test_signing.py checks).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

SECRET_PREFIX = "whsec_"


def secret_key(secret: str) -> bytes:
    """The HMAC key of a listener secret."""
    raw = secret[len(SECRET_PREFIX):] if secret.startswith(SECRET_PREFIX) else secret
    try:
        key = base64.b64decode(raw + "==", validate=False)
    except (binascii.Error, ValueError):
        key = b""
    # A secret that is not base64 at all still signs (with its bytes), never crashes.
    return key or secret.encode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value for one request."""
    to_sign = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret_key(secret), to_sign, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signature_headers(secret: str, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(secret, msg_id, timestamp, body),
    }
