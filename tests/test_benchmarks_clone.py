"""Every benchmarks/*.py runs at smoke size from a clone-like tree (tracked files only, no ../shared beside it),
so a benchmark that reads a file outside the repo, or one nobody committed, fails CI (issue 17, finding 2).

Each smoke run takes seconds (about 45 s for all of them on 2 shared cores); the figures are not checked, only
that the benchmark runs to the end and prints its table.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.clone import ROOT, NotACheckout, clone_env, clone_tree

pytestmark = pytest.mark.slow

BENCHMARKS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
# what each smoke run must print (a line of its table), so a run that printed nothing does not pass
EXPECT = {
    "control_plane.py": "seq-steps/s",
    "cpu_model.py": "atlas chunks",
    "cuda_features.py": "ring snapshot",
    "dispatch_count.py": " ops (",
    "invariance.py": "completions identical",
    "kernels.py": "dry run:",
    "mini_figures.py": "watchdog shard",
    "mini_tpot.py": "TPOT ms",
    "multiturn.py": "tokens equal on/off",
    "mutation_campaign.py": "acceptance",
    "replay_check.py": "state-only check",
    "rollback.py": "restore a snapshot",
    "spec_divergence.py": '"identical"',
    "speculative.py": "oracle",
    "stamp_read.py": "fast ms/call",
    "host_profile.py": "control_plane_ms",
    "sampling.py": "over argmax",
    "server_flood.py": "verdict:",
    "server_trace.py": "events/step",
    "tp_check.py": "greedy tokens equal: True",
    "train_step.py": "train step,",
}


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        return clone_tree(tmp_path_factory.mktemp("clone"))
    except NotACheckout as exc:
        pytest.skip(str(exc))


def _run(clone: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=clone, env=clone_env(clone), capture_output=True, text=True,
                          timeout=timeout)


def test_every_benchmark_has_an_expectation() -> None:
    assert set(BENCHMARKS) == set(EXPECT), "add the new benchmark (and a --smoke flag) to EXPECT"


def test_the_clone_imports_its_own_atlas(clone: Path) -> None:
    out = _run(clone, "-c", "import atlas, atlas_kernels; print(atlas.__file__); print(atlas_kernels.__file__)")
    assert out.returncode == 0, out.stderr
    atlas_file, kernels_file = out.stdout.split()
    assert Path(atlas_file).is_relative_to(clone) and Path(kernels_file).is_relative_to(clone.parent)
    assert not (clone.parent / "shared").exists() and not (clone / ".." / "shared").exists()


@pytest.mark.parametrize("name", BENCHMARKS)
def test_benchmark_runs_at_smoke_size_in_a_clone(clone: Path, name: str) -> None:
    out = _run(clone, f"benchmarks/{name}", "--smoke")
    assert out.returncode == 0, f"{name} --smoke exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert EXPECT[name] in out.stdout, out.stdout[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path only exists without a GPU")
def test_the_gpu_benchmark_fails_clearly_without_a_gpu(clone: Path) -> None:
    out = _run(clone, "benchmarks/kernels.py", "--only", "gdn")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in out.stderr
    bad = _run(clone, "benchmarks/kernels.py", "--dry-run", "--only", "nope")
    assert bad.returncode == 2 and "not a kernel group" in bad.stderr
