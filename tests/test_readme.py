"""The README works in a clone (issue 17, finding 2 and the acceptance): it links only files in the repository,
and every command block runs, at small sizes, in a clone-like copy (tools/readme_check.py --ci: benchmark and pytest
lines only need their files there, since tests/test_benchmarks_clone.py and the suite run them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
sys.path.insert(0, str(ROOT / "tools"))

import readme_check  # noqa: E402 (tools/ on the path first)


def test_readme_links_only_files_in_the_repository() -> None:
    assert "../shared" not in README
    targets = re.findall(r"\]\(([^)#]+)\)", README)
    assert "docs/ARCHITECTURE.md" in targets
    for target in targets:
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links {target}, which the repository does not have"


def test_the_checker_reads_commands_as_a_shell_would() -> None:
    text = "x\n```bash\na --b 1   # a comment\nc 'd # not a comment' \\\n    --e 2\n\n```\n```python\nprint(1)\n```\n"
    cmds = readme_check.commands(text)
    assert [(c.lang, c.text) for c in cmds] == [("bash", "a --b 1"), ("bash", "c 'd # not a comment' --e 2"),
                                                ("python", "print(1)\n")]


@pytest.mark.slow
def test_every_readme_command_block_runs_in_a_clone() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "readme_check.py"), "--ci"],
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert "every README command ran" in out.stdout
    assert "FAIL" not in out.stdout
