"""Auth fails closed: an empty key is an error, the key need not be in argv, a non-loopback host needs a key or
--allow-unauthenticated, the start-up log says which, and `bench serve` stops at the first 401."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.serving import ServeProcess, free_port

from atlas.server.auth import AuthConfigError, check_exposure, is_loopback, resolve_api_key

ATLAS = [sys.executable, "-c", "from atlas.cli import main; main()"]


def test_an_empty_key_is_an_error_wherever_it_comes_from(tmp_path: Path) -> None:
    with pytest.raises(AuthConfigError, match="--api-key is empty"):
        resolve_api_key("", None, env={})
    with pytest.raises(AuthConfigError, match="ATLAS_API_KEY is empty"):
        resolve_api_key(None, None, env={"ATLAS_API_KEY": ""})
    empty = tmp_path / "empty"
    empty.write_text("\n  \n")
    with pytest.raises(AuthConfigError, match="--api-key-file .* is empty"):
        resolve_api_key(None, str(empty), env={})
    with pytest.raises(AuthConfigError, match="cannot read it"):
        resolve_api_key(None, str(tmp_path / "missing"), env={})
    with pytest.raises(AuthConfigError, match="not both"):
        resolve_api_key("k", str(empty), env={})
    with pytest.raises(AuthConfigError, match="visible ASCII"):
        resolve_api_key("two words", None, env={})


def test_where_the_key_comes_from(tmp_path: Path) -> None:
    f = tmp_path / "key"
    f.write_text("  from-file  \nsecond line ignored\n")
    assert resolve_api_key(None, str(f), env={"ATLAS_API_KEY": "env"}).api_key == "from-file"
    assert resolve_api_key("flag", None, env={"ATLAS_API_KEY": "env"}).api_key == "flag"
    env = resolve_api_key(None, None, env={"ATLAS_API_KEY": "from-env"})
    assert env.api_key == "from-env" and env.source == "ATLAS_API_KEY"
    none = resolve_api_key(None, None, env={})
    assert none.api_key is None and not none.enabled


def test_a_non_loopback_host_needs_a_key_or_an_explicit_flag() -> None:
    off = resolve_api_key(None, None, env={})
    on = resolve_api_key("k", None, env={})
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert is_loopback(host)
        check_exposure(host, off, False)
    for host in ("0.0.0.0", "::", "10.1.2.3", "my-host.example"):
        assert not is_loopback(host)
        with pytest.raises(AuthConfigError, match="--allow-unauthenticated"):
            check_exposure(host, off, False)
        check_exposure(host, off, True)
        check_exposure(host, on, False)


@pytest.mark.parametrize(("args", "env", "expected"), [
    (["--api-key", ""], {}, "--api-key is empty"),
    ([], {"ATLAS_API_KEY": ""}, "ATLAS_API_KEY is empty"),
    (["--host", "0.0.0.0"], {}, "--allow-unauthenticated"),
])
def test_serve_refuses_to_start_open_by_mistake(args: list[str], env: dict[str, str], expected: str) -> None:
    import os

    full_env = {k: v for k, v in os.environ.items() if k != "ATLAS_API_KEY"} | env
    out = subprocess.run([*ATLAS, "serve", "--backend", "null", "--port", str(free_port()), *args],
                         capture_output=True, text=True, timeout=120, env=full_env)
    assert out.returncode == 2, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert expected in text and "Traceback" not in text


def test_start_up_log_says_auth_is_off_and_where(tmp_path: Path) -> None:
    with ServeProcess(tmp_path, "--backend", "null", "--allow-unauthenticated", host="0.0.0.0") as server:
        server.wait_ready()
        server.signal(signal.SIGTERM)
        assert server.wait() == 0
        logs = server.logs()
    assert "auth is OFF" in logs and "from the network (--allow-unauthenticated)" in logs
    assert "auth=off" in logs and "host=0.0.0.0" in logs


def test_the_key_from_the_environment_is_enforced(tmp_path: Path) -> None:
    import httpx

    with ServeProcess(tmp_path, "--backend", "null", env={"ATLAS_API_KEY": "env-key"}) as server:
        server.wait_ready()
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        ok = httpx.get(f"{server.url}/v1/models", headers={"authorization": "Bearer env-key"})
        assert ok.status_code == 200
        out = subprocess.run([*ATLAS, "bench", "serve", "--base-url", server.url, "--num-prompts", "8"],
                             capture_output=True, text=True, timeout=120,
                             env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        assert out.returncode == 1, out.stdout + out.stderr
        lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
        assert len(lines) == 1 and "HTTP 401" in lines[0] and "ATLAS_API_KEY" in lines[0], lines
        key_file = tmp_path / "key"
        key_file.write_text("env-key\n")
        good = subprocess.run([*ATLAS, "bench", "serve", "--base-url", server.url, "--num-prompts", "4",
                               "--random-output-len", "4", "--api-key-file", str(key_file)],
                              capture_output=True, text=True, timeout=120)
        assert good.returncode == 0 and "Successful requests:" in good.stdout, good.stdout + good.stderr
        assert "auth='on (ATLAS_API_KEY)'" in server.logs()
