"""Run every command block of README.md, at small sizes, in a clone-like copy of the repository.

    .venv/bin/python tools/readme_check.py                  # all blocks; exit 1 if any command fails
    .venv/bin/python tools/readme_check.py --ci             # what CI runs (tests/test_readme.py)

The copy holds only the files git tracks (nothing beside it, so nothing from ../shared), with this checkout's
virtualenv linked in; commands run there in order, as a newcomer would type them, sharing the files they write
(run.db, spec.db, ...). What is changed, and why:
- `bin/atlas serve ...` starts in the background on a free port (every 127.0.0.1:8000 in later commands points
  there) and runs until the next serve line or the end; it must answer /health and exit 0 on Ctrl-C (SIGINT);
- `bench serve` sends 4 prompts of 16 -> 4 tokens; `benchmarks/*.py` run with --smoke and `pytest ...` lines
  only collect; with --ci both only check that the files they name are in the clone, since the suite runs
  those already (tests/test_benchmarks_clone.py runs every benchmark at smoke size in a clone); `curl` gets -f
  so an HTTP error fails;
- without a GPU, a CUDA command must fail with exit status 2 and one stderr line (what such a user sees);
  `bin/test` (this check is part of it) and `benchmarks/gpu_run.sh` (the GPU machine's) are skipped;
- `trace minimize` of a healthy trace must say "cannot minimise" with exit 1, as the README documents.
```python blocks run with the venv's python.
"""

from __future__ import annotations

import argparse
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fixtures.clone import clone_env, clone_tree  # noqa: E402 (tests/ on the path first)

FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
ASSIGNMENT = re.compile(r"^(export\s+)?([A-Za-z_]\w*)=(\$\(.*\)|\S+)$")


@attrs.frozen
class Command:
    block: int
    lang: str  # "bash" | "python"
    text: str


def strip_comment(line: str) -> str:
    """The line without its `# ...` comment (a # at the start or after a space, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def commands(readme: str) -> list[Command]:
    out = []
    for n, m in enumerate(FENCE.finditer(readme)):
        lang, body = m.group(1), m.group(2)
        if lang == "python":
            out.append(Command(n, lang, body))
            continue
        if lang not in ("bash", "sh"):
            continue
        logical = re.sub(r"\s*\\\n\s*", " ", body)  # continuation lines
        for raw in logical.splitlines():
            line = strip_comment(raw).strip()
            if line:
                out.append(Command(n, "bash", line))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@attrs.define
class Runner:
    root: Path
    env: dict[str, str]
    ci: bool
    has_gpu: bool
    port: int = attrs.Factory(free_port)
    server: subprocess.Popen | None = None
    server_log: Path | None = None
    failures: list[str] = attrs.Factory(list)

    def rewrite(self, text: str) -> str:
        text = text.replace("127.0.0.1:8000", f"127.0.0.1:{self.port}")
        text = re.sub(r"(^|\s)\.\.\.(?=\s|$)", " ", text)  # README placeholders
        if " bench serve" in text:
            for flag, value in (("--num-prompts", 4), ("--max-concurrency", 2), ("--random-input-len", 16),
                                ("--random-output-len", 4)):
                text = re.sub(rf"{flag} \S+", f"{flag} {value}", text) if flag in text else f"{text} {flag} {value}"
        return text

    def kind(self, text: str) -> str:
        words = text.split()
        head = next((w for w in words if "=" not in w), "")
        if head == "bin/test":
            return "skip:the test suite itself runs this check"
        if "gpu_run.sh" in text or "train_gpu.sh" in text:
            return "skip:the GPU machine's script (carried wheels, a GPU)"
        gpu = "--backend cuda" in text or " bench gpu" in text
        if gpu and not self.has_gpu:
            return "no-gpu"
        if gpu and " bench gpu" in text:
            return "skip:minutes of GPU time"
        if re.search(r"bin/atlas serve(\s|$)", text):
            return "serve"
        if "-m pytest" in text:
            return "pytest"
        if re.search(r"benchmarks/\w+\.py", text):
            return "benchmark"
        if " trace minimize" in text:
            return "minimize-healthy"
        return "run"

    def start_server(self, text: str) -> str | None:
        stopped = self.stop_server()
        if stopped is not None:
            return f"the previous server {stopped}"
        self.server_log = Path(tempfile.mkstemp(prefix="atlas-serve-", suffix=".log")[1])
        log = self.server_log.open("w")
        # exec env: the server is bash's replacement (it gets the SIGINT), NAME=value prefixes still apply
        self.server = subprocess.Popen(["bash", "-c", f"exec env {text} --port {self.port}"], cwd=self.root,
                                       env=self.env, stdout=log, stderr=subprocess.STDOUT)
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                return f"exited {self.server.returncode} before answering: {self._log_tail()}"
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return "no /health answer within 120 s"

    def stop_server(self) -> str | None:
        if self.server is None:
            return None
        server, self.server = self.server, None
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                return "did not stop within 30 s of SIGINT"
        # 130: Ctrl-C's own status (uvicorn re-raises the signal once it has shut down cleanly)
        return None if server.returncode in (0, 130) else f"exited {server.returncode} on SIGINT: {self._log_tail()}"

    def _log_tail(self) -> str:
        return self.server_log.read_text()[-800:] if self.server_log else ""

    def run(self, cmd: Command) -> None:
        text = self.rewrite(cmd.text) if cmd.lang == "bash" else cmd.text.replace("127.0.0.1:8000",
                                                                                   f"127.0.0.1:{self.port}")
        kind = "python" if cmd.lang == "python" else self.kind(text)
        shown = " ".join(cmd.text.split())[:110]
        start = time.monotonic()
        problem = None
        if kind.startswith("skip:"):
            print(f"skip        {shown}  ({kind[5:]})", flush=True)
            return
        assignment = ASSIGNMENT.match(text) if cmd.lang == "bash" else None
        if assignment:  # `NAME=value` on its own line: later lines of the session see it
            name = assignment.group(2)
            got = subprocess.run(["bash", "-c", f'{text}; printf %s "${name}"'], cwd=self.root, env=self.env,
                                 capture_output=True, text=True, timeout=60)
            problem = None if got.returncode == 0 and got.stdout else f"exit {got.returncode}: {got.stderr[-400:]}"
            if problem is None:
                self.env[name] = got.stdout
        if assignment:
            pass
        elif kind == "serve":
            problem = self.start_server(text)
        else:
            argv = ["bash", "-c", text]
            if kind == "python":
                argv = [str(self.root / ".venv" / "bin" / "python"), "-c", text]
            elif kind in ("benchmark", "pytest") and self.ci:
                files = re.findall(r"(?:benchmarks|tests)/\w+\.py", text)
                argv = ["bash", "-c", " && ".join(f"test -f {f}" for f in files)]
            elif kind == "benchmark":
                argv = ["bash", "-c", f"{text} --smoke"]
            elif kind == "pytest":
                argv = ["bash", "-c", f"{text} --collect-only -q -p no:cacheprovider"]
            elif text.startswith("curl "):
                argv = ["bash", "-c", "curl -f --max-time 60 " + text[len("curl "):]]
            out = subprocess.run(argv, cwd=self.root, env=self.env, capture_output=True, text=True, timeout=600)
            problem = self.judge(kind, out)
        status = "ok  " if problem is None else "FAIL"
        print(f"{status} {time.monotonic() - start:6.1f}s {shown}", flush=True)
        if problem is not None:
            print(f"       {problem}", flush=True)
            self.failures.append(f"{shown}: {problem}")

    @staticmethod
    def judge(kind: str, out: subprocess.CompletedProcess[str]) -> str | None:
        tail = (out.stdout[-600:] + out.stderr[-1200:]).strip()
        if kind == "no-gpu":
            lines = [line for line in out.stderr.splitlines() if line.strip()]
            if out.returncode != 2 or len(lines) != 1:
                return f"without a GPU: expected exit 2 and one stderr line, got {out.returncode}: {tail}"
            return None
        if kind == "minimize-healthy":
            if out.returncode == 1 and out.stdout.startswith("cannot minimise"):
                return None
            if out.returncode == 0:
                return None
            return f"exit {out.returncode}: {tail}"
        return None if out.returncode == 0 else f"exit {out.returncode}: {tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ci", action="store_true",
                    help="benchmark and pytest lines: only check their files exist (the suite runs them)")
    ap.add_argument("--in-place", action="store_true", help="run in this checkout instead of a clone-like copy")
    args = ap.parse_args()
    import torch

    readme = (ROOT / "README.md").read_text()
    with tempfile.TemporaryDirectory(prefix="atlas-readme-") as tmp:
        root = ROOT if args.in_place else clone_tree(Path(tmp))
        env = clone_env(root)
        runner = Runner(root, env, args.ci, torch.cuda.is_available())
        cmds = commands(readme)
        print(f"README.md: {len(cmds)} commands in {len({c.block for c in cmds})} blocks, run in {root}",
              flush=True)
        try:
            for cmd in cmds:
                runner.run(cmd)
        finally:
            problem = runner.stop_server()
            if problem:
                runner.failures.append(f"the last server: {problem}")
    print(f"{len(runner.failures)} failed" if runner.failures else "every README command ran", flush=True)
    return 1 if runner.failures else 0


if __name__ == "__main__":
    sys.exit(main())
