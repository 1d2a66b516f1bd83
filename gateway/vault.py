"""Secrets at rest: AES-256-GCM under a master key taken from the environment, never from the DB.

`WEIR_MASTER_KEY` holds one or more comma-separated keys (32 bytes each, base64); the first encrypts,
every one of them decrypts, and `WEIR_MASTER_KEY_PREVIOUS` adds more keys that only decrypt. Rotation:
put the new key first (`WEIR_MASTER_KEY=new,old`), run `weir db rotate-master-key` to re-encrypt every
row under it, then drop the old key.

A token is `v1:<key id>:<base64url(nonce || ciphertext || tag)>`. The key id (a hash of the key, not
the key) says which key to use, so a missing key is reported by name instead of as garbage. The
caller's `context` (e.g. the backend's name) is authenticated with the data, so a ciphertext copied
to another row or another backend does not decrypt.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Mapping, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

ENV = "WEIR_MASTER_KEY"
ENV_PREVIOUS = "WEIR_MASTER_KEY_PREVIOUS"
VERSION = "v1"
KEY_BYTES = 32
NONCE_BYTES = 12


class VaultError(Exception):
    """A secret could not be stored or read; the message says why and what to do."""


def generate_key() -> str:
    return base64.urlsafe_b64encode(os.urandom(KEY_BYTES)).decode()


def key_id(key: bytes) -> str:
    return hashlib.sha256(b"weir-master-key\0" + key).hexdigest()[:8]


def _parse_key(text: str, where: str) -> bytes:
    try:
        key = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise VaultError(
            f"{where} is not a master key: each key must be {KEY_BYTES} random bytes in base64 "
            "(make one with `weir db new-master-key`)"
        )
    return key


class Vault:
    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise VaultError("a vault needs at least one master key")
        self._primary = keys[0]
        self.primary_id = key_id(keys[0])
        self._keys = {key_id(k): AESGCM(k) for k in keys}

    @property
    def key_ids(self) -> list[str]:
        return list(self._keys)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Vault | None:
        """The vault for `WEIR_MASTER_KEY` (+ `WEIR_MASTER_KEY_PREVIOUS`); None when none is set.
        A malformed key raises VaultError: better to refuse to start than to run without one."""
        env = os.environ if env is None else env
        texts: list[tuple[str, str]] = []
        for name in (ENV, ENV_PREVIOUS):
            parts = [p.strip() for p in env.get(name, "").split(",") if p.strip()]
            texts += [(p, f"{name} key {i + 1}") for i, p in enumerate(parts)]
        if not texts or not env.get(ENV, "").strip():
            if texts:
                raise VaultError(f"{ENV_PREVIOUS} is set but {ENV} is not: set the current key in {ENV}")
            return None
        return cls([_parse_key(text, where) for text, where in texts])

    def encrypt(self, plaintext: str, context: str) -> str:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._keys[self.primary_id].encrypt(nonce, plaintext.encode(), context.encode())
        return f"{VERSION}:{self.primary_id}:{base64.urlsafe_b64encode(nonce + sealed).decode()}"

    def decrypt(self, token: str, context: str) -> str:
        version, kid, data = _split(token)
        if version != VERSION:
            raise VaultError(f"unknown secret format {version!r}")
        aead = self._keys.get(kid)
        if aead is None:
            raise VaultError(
                f"the secret was encrypted with master key {kid}, which is not in {ENV} or "
                f"{ENV_PREVIOUS} (this gateway has {', '.join(self._keys)})"
            )
        try:
            raw = base64.urlsafe_b64decode(data)
            return aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], context.encode()).decode()
        except (InvalidTag, binascii.Error, ValueError):
            raise VaultError(
                f"the secret does not decrypt with master key {kid}: it was altered or moved from another row"
            ) from None

    def rotate(self, token: str, context: str) -> str:
        """The same secret under the primary key (the token itself when it already is)."""
        if token_key_id(token) == self.primary_id:
            self.decrypt(token, context)  # still proves it is intact
            return token
        return self.encrypt(self.decrypt(token, context), context)


def _split(token: str) -> tuple[str, str, str]:
    parts = token.split(":", 2)
    if len(parts) != 3:
        raise VaultError("not an encrypted secret (expected v1:<key id>:<data>)")
    return parts[0], parts[1], parts[2]


def token_key_id(token: str) -> str:
    return _split(token)[1]


def fingerprint(secret: str) -> str:
    """Names a secret without revealing it: enough to tell two keys apart, useless for guessing."""
    return hashlib.sha256(secret.encode()).hexdigest()[:16]
