"""Where the API key comes from, and the rules that make auth fail closed.

- `--api-key KEY`, `--api-key-file PATH` (first line, surrounding whitespace dropped) or `ATLAS_API_KEY`, in
  that order; the flag puts the key in `ps` for every local user to read, so the other two are preferred.
- An empty key is an error, never "auth off": an unset `$KEY` in `--api-key "$KEY"` used to turn auth off.
- A host other than loopback without a key needs `--allow-unauthenticated`.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import attrs

ENV_VAR = "ATLAS_API_KEY"


class AuthConfigError(ValueError):
    """A usage error: the message names the flag and what to do."""


@attrs.frozen
class AuthSettings:
    api_key: str | None
    source: str  # "--api-key", "--api-key-file PATH", "ATLAS_API_KEY", or "none"

    @property
    def enabled(self) -> bool:
        return self.api_key is not None


def _check(key: str, source: str) -> str:
    if not key:
        raise AuthConfigError(f"{source} is empty: give a non-empty key, or leave it out to serve without auth "
                              f"(loopback only, unless --allow-unauthenticated)")
    if any(not (33 <= ord(c) <= 126) for c in key):
        raise AuthConfigError(f"{source}: the key may hold only visible ASCII characters (no spaces or control "
                              f"characters), as an 'Authorization: Bearer <key>' header carries it")
    return key


def resolve_api_key(api_key: str | None, api_key_file: str | None, env: dict[str, str] | None = None
                    ) -> AuthSettings:
    env = dict(os.environ) if env is None else env
    if api_key is not None and api_key_file is not None:
        raise AuthConfigError("give one of --api-key and --api-key-file, not both")
    if api_key is not None:
        return AuthSettings(_check(api_key, "--api-key"), "--api-key")
    if api_key_file is not None:
        path = Path(api_key_file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise AuthConfigError(f"--api-key-file {api_key_file}: cannot read it ({type(exc).__name__}: "
                                  f"{exc.strerror if isinstance(exc, OSError) else exc})") from None
        lines = text.strip().splitlines()
        return AuthSettings(_check(lines[0].strip() if lines else "", f"--api-key-file {api_key_file}"),
                            f"--api-key-file {api_key_file}")
    if ENV_VAR in env:  # set but empty is an error too: it is how an unset variable reaches us
        return AuthSettings(_check(env[ENV_VAR].strip(), ENV_VAR), ENV_VAR)
    return AuthSettings(None, "none")


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_exposure(host: str, auth: AuthSettings, allow_unauthenticated: bool) -> None:
    """A server reachable from other machines without a key is refused unless asked for explicitly."""
    if auth.enabled or is_loopback(host) or allow_unauthenticated:
        return
    raise AuthConfigError(f"--host {host} is not loopback and no API key is set: anyone who can reach it could "
                          f"use it. Set --api-key-file PATH or {ENV_VAR}, or pass --allow-unauthenticated")
