"""The wheel holds every package of the source tree (discovery, not a hand list), and it imports on its own."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _packages(root: Path, name: str) -> set[str]:
    return {name + "".join("." + part for part in p.parent.relative_to(root).parts)
            for p in root.rglob("__init__.py") if "__pycache__" not in p.parts}


def test_the_wheel_holds_every_package_and_imports_the_engine(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path)], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("atlas_engine-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {n[: -len("/__init__.py")].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    want = _packages(ROOT / "atlas", "atlas") | _packages(ROOT / "kernels", "atlas_kernels")
    assert want <= in_wheel, f"missing from the wheel: {sorted(want - in_wheel)}"
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "atlas").rglob("*.py") if "__pycache__" not in p.parts}
    assert modules <= set(names), f"modules missing from the wheel: {sorted(modules - set(names))}"
    # installed from the wheel alone (no source tree on the path), the engine imports
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    probe = ("import atlas, atlas.engine.engine, atlas.registry, atlas.server.app, atlas_kernels; "
             "print(atlas.__file__)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False,
                         cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().startswith(str(target)), run.stdout
