"""Every benchmarks/*.py runs at smoke size from a clone-like tree (tracked files only, no ../shared beside it),
so a benchmark that reads a file outside the repo, or one nobody committed, fails CI (issue 17, finding 2).

The figures are not checked, only that the benchmark runs to the end and prints its table. Each runs as
`python benchmarks/NAME.py --smoke` would, in a fork of one python that imported torch once
(tests/fixtures/preloaded.py: 22 imports of torch were about 2.7 s of CPU each).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.clone import ROOT, NotACheckout, clone_env, clone_tree
from fixtures.preloaded import Preloaded

pytestmark = pytest.mark.slow

BENCHMARKS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
# what each smoke run must print (a line of its table), so a run that printed nothing does not pass
EXPECT = {
    "backend_host.py": "execute host us / step",
    "control_plane.py": "seq-steps/s",
    "cpu_model.py": "atlas chunks",
    "cuda_features.py": "ring snapshot",
    "dispatch_count.py": " ops (",
    "invariance.py": "completions identical",
    "kernels.py": "dry run:",
    "mini_figures.py": "watchdog shard",
    "mini_tpot.py": "TPOT ms",
    "multiturn.py": "tokens equal on/off",
    "ngram_cache.py": "ms/step cached",
    "mutation_campaign.py": "acceptance",
    "prefill_runs.py": "runs ms",
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


@pytest.fixture(scope="module")
def preloaded(clone: Path):  # type: ignore[no-untyped-def]
    runner = Preloaded(clone, clone_env(clone))
    yield runner
    runner.close()


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
def test_benchmark_runs_at_smoke_size_in_a_clone(preloaded: Preloaded, name: str) -> None:
    out = preloaded.run([f"benchmarks/{name}", "--smoke"], timeout=120)
    assert out.returncode == 0, f"{name} --smoke exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    assert EXPECT[name] in out.stdout, out.stdout[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path only exists without a GPU")
def test_the_gpu_benchmark_fails_clearly_without_a_gpu(preloaded: Preloaded) -> None:
    out = preloaded.run(["benchmarks/kernels.py", "--only", "gdn"], timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in out.stderr
    bad = preloaded.run(["benchmarks/kernels.py", "--dry-run", "--only", "nope"], timeout=120)
    assert bad.returncode == 2 and "not a kernel group" in bad.stderr


PROBE = """import atexit, json, os, sys, threading
atexit.register(lambda: print("atexit ran", flush=True))
printed = threading.Event()
threading.Thread(target=lambda: printed.wait() and print("thread ran")).start()  # joined at the exit
print(json.dumps([sys.argv, sys.path[0], __name__, __file__, sys.stdin.read(), os.getcwd(), "atlas" in sys.modules]))
print("to stderr", file=sys.stderr)
printed.set()
if "--sleep" in sys.argv:
    import time
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


def test_a_preloaded_run_is_a_plain_runs_twin(clone: Path, preloaded: Preloaded, tmp_path: Path) -> None:
    """What the benchmarks' runs rest on: exit status, stdout, stderr, argv, sys.path[0], __main__, __file__,
    stdin, cwd, atexit and threads as `python SCRIPT` gives them, nothing of atlas imported, and the timeout."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    got = preloaded.run([str(script), "3"], timeout=60)
    want = subprocess.run([sys.executable, str(script), "3"], cwd=clone, env=clone_env(clone), capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr) == (
        3, want.stdout, "to stderr\n")
    assert want.stdout.endswith("thread ran\natexit ran\n") and '"__main__"' in want.stdout
    with pytest.raises(subprocess.TimeoutExpired):
        preloaded.run([str(script), "0", "--sleep"], timeout=1)
    assert preloaded.run([str(script), "0"], timeout=60).returncode == 0  # the server outlives a killed script
