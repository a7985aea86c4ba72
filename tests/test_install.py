"""The install: pyproject's requirements resolve against torch builds that pin their own triton (the public
registry's Linux builds), and bin/bootstrap makes a serve-only venv without the dev toolchain, a dev venv on top of
it, and keeps a system torch with ATLAS_USE_SYSTEM_TORCH=1. pip's real resolver runs against metadata-only wheels
(tests/fixtures/fake_wheels.py): no network, nothing downloaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.fixtures.fake_wheels import ROOT, TORCH_TRITON, build_index, project_requirements

DEV_ONLY = {"pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "ruff", "transformers", "openai", "lm-eval",
            "triton"}


def pip_env(index: Path) -> dict[str, str]:
    """pip against the fake index alone: no config file, no other index or wheel folder, no constraints."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHONUSERBASE"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index),
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")
    return env


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_index(tmp_path_factory.mktemp("index"))


def resolve(index: Path, requirements: list[str], tmp: Path) -> dict[str, str]:
    report = tmp / "report.json"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(report), *requirements], env=pip_env(index), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return {i["metadata"]["name"].lower(): i["metadata"]["version"]
            for i in json.loads(report.read_text())["install"]}


def test_the_fake_index_reproduces_the_old_pin_s_conflict(index: Path, tmp_path: Path) -> None:
    # the fixture is faithful: torch 2.13.0 with the triton 3.6.0 pin pyproject used to carry cannot resolve
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "torch==2.13.0", "triton==3.6.0"], env=pip_env(index), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "ResolutionImpossible" in proc.stderr


@pytest.mark.parametrize("torch_version", ["2.13.0", "2.15.0"])
def test_requirements_resolve_with_the_triton_torch_pins(index: Path, tmp_path: Path, torch_version: str) -> None:
    runtime, dev = project_requirements()
    got = resolve(index, [f"torch=={torch_version}", *map(str, runtime), *map(str, dev)], tmp_path)
    assert got["torch"] == torch_version
    want = TORCH_TRITON[torch_version].lstrip("=~")
    assert got["triton"].startswith(want.rsplit(".", 1)[0]) and got["triton"] >= want


def test_unpinned_requirements_take_the_newest_torch_without_backtracking(index: Path, tmp_path: Path) -> None:
    runtime, dev = project_requirements()
    got = resolve(index, [*map(str, runtime), *map(str, dev)], tmp_path)
    assert (got["torch"], got["triton"]) == ("2.15.0", "3.9.0")


def test_runtime_requirements_hold_no_dev_package() -> None:
    runtime, dev = project_requirements()
    assert {r.name.lower() for r in runtime} & DEV_ONLY == set()
    assert DEV_ONLY - {"triton"} <= {r.name.lower() for r in dev}


def project_copy(tmp: Path) -> Path:
    """What `pip install -e .` needs of the checkout, and bin/bootstrap."""
    root = tmp / "atlas-checkout"
    (root / "bin").mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, root / name)
    shutil.copy2(ROOT / "bin" / "bootstrap", root / "bin" / "bootstrap")
    for package in ("atlas", "kernels"):
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def bootstrap(root: Path, mode: str, env: dict[str, str]) -> None:
    proc = subprocess.run(["bash", str(root / "bin" / "bootstrap"), mode], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr + (root / ".venv" / "install.log").read_text()


def installed(root: Path) -> dict[str, str]:
    out = subprocess.run([str(root / ".venv" / "bin" / "python"), "-m", "pip", "list", "--format", "json"],
                         env={**os.environ, "PIP_CONFIG_FILE": os.devnull}, capture_output=True, text=True,
                         check=True).stdout
    return {p["name"].lower(): p["version"] for p in json.loads(out)}


def base_python() -> str:
    """The interpreter the venvs are made from: this one's base (a venv of a venv is not one of the base)."""
    return str(Path(sysconfig.get_config_var("BINDIR")) / f"python{sys.version_info.major}.{sys.version_info.minor}")


@pytest.mark.slow
def test_bootstrap_serve_venv_has_no_dev_package_and_test_adds_them(index: Path, tmp_path: Path) -> None:
    root = project_copy(tmp_path)
    env = {**pip_env(index), "PYTHON": base_python()}
    bootstrap(root, "runtime", env)
    serve = installed(root)
    assert serve["torch"] == "2.13.0" and serve["triton"] == "3.7.1"  # torch's own triton, nothing else's
    assert set(serve) & (DEV_ONLY - {"triton"}) == set()
    bootstrap(root, "dev", env)
    dev = installed(root)
    assert (dev["torch"], dev["triton"]) == ("2.13.0", "3.7.1")
    assert DEV_ONLY <= set(dev)


@pytest.mark.slow
def test_bootstrap_gives_a_cpu_torch_the_tested_triton(tmp_path: Path) -> None:
    # a torch that pins no triton (a CPU build): the dev venv gets the newest triton the kernel tests are checked
    # with (< 3.8), not the registry's newest (3.9.0 here); the serve venv gets none
    index = build_index(tmp_path / "cpu-index", cpu_torch=True)
    root = project_copy(tmp_path)
    env = {**pip_env(index), "PYTHON": base_python()}
    bootstrap(root, "runtime", env)
    assert "triton" not in installed(root)
    bootstrap(root, "dev", env)
    assert installed(root)["triton"] == "3.7.1"


@pytest.mark.slow
def test_bootstrap_keeps_the_system_torch(index: Path, tmp_path: Path) -> None:
    # the "system" torch: a torch 2.11.0 in the user site, which only a --system-site-packages venv sees
    user = tmp_path / "user"
    site = user / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site.mkdir(parents=True)
    for wheel in (*index.glob("torch-2.11.0-*.whl"), *index.glob("triton-3.6.0-*.whl")):
        zipfile.ZipFile(wheel).extractall(site)
    root = project_copy(tmp_path)
    env = {**pip_env(index), "PYTHON": base_python(), "PYTHONUSERBASE": str(user),
           "ATLAS_USE_SYSTEM_TORCH": "1"}
    bootstrap(root, "runtime", env)
    probe = subprocess.run([str(root / ".venv" / "bin" / "python"), "-c", "import torch; print(torch.__version__, "
                            "torch.__file__)"], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert probe[0] == "2.11.0" and probe[1].startswith(str(site))
    assert not list((root / ".venv").glob("lib/python*/site-packages/torch"))


def test_bootstrap_without_a_system_torch_refuses_the_flag(tmp_path: Path) -> None:
    root = project_copy(tmp_path)
    env = {**os.environ, "ATLAS_USE_SYSTEM_TORCH": "1", "PYTHON": base_python(), "PYTHONUSERBASE": str(tmp_path)}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", str(root / "bin" / "bootstrap"), "runtime"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "ATLAS_USE_SYSTEM_TORCH=1" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_entry_scripts_install_their_own_mode() -> None:
    assert '"$root/bin/bootstrap" runtime' in (ROOT / "bin" / "atlas").read_text()
    assert '"$root/bin/bootstrap" dev' in (ROOT / "bin" / "test").read_text()
