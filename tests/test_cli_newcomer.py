"""What a new user meets on the command line (issue 17): the thread policy and a small --max-tokens default
(finding 1), one-line errors with exit status 2 for usage mistakes (finding 4), checkpoints (finding 5),
`replay against` on a healthy trace (finding 6), and output: results on stdout, logs on stderr, a readable
`trace show`, plain --help (finding 7).

Commands run in-process through `atlas.cli.run` (what `atlas` runs), so stdout and stderr are captured apart.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atlas.cli import run
from atlas.threads import ThreadsError, resolve_threads


@pytest.fixture(autouse=True)
def _no_thread_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("ATLAS_DEBUG", raising=False)


def atlas(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"stderr is not one line: {err!r}"
    return lines[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """atlas-tiny as a checkpoint dir (no tokenizer.json) whose max_position_embeddings is 512."""
    from atlas.model.tiny import save

    root = save(tmp_path_factory.mktemp("ckpt") / "tiny-512")
    config = json.loads((root / "config.json").read_text())
    config["max_position_embeddings"] = 512
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def gen_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's run.db: a 16-token greedy generate on the cpu backend."""
    trace = tmp_path_factory.mktemp("gen") / "run.db"
    assert run(["generate", "--prompt", "Hello", "--max-tokens", "16", "--trace", str(trace)]) == 0
    return trace


# finding 1: threads and --max-tokens


def test_the_thread_policy_explicit_then_env_then_measured_default() -> None:
    assert resolve_threads(None, environ={}) == 1 and resolve_threads(None, exact=False, environ={}) == 1
    assert resolve_threads(None, environ={"OMP_NUM_THREADS": "3"}) == 3
    assert resolve_threads(2, environ={"OMP_NUM_THREADS": "3"}) == 2
    with pytest.raises(ThreadsError, match="--threads"):
        resolve_threads(0)
    with pytest.raises(ThreadsError, match="OMP_NUM_THREADS"):
        resolve_threads(None, environ={"OMP_NUM_THREADS": "many"})


def test_generate_and_replay_size_torch_threads_by_the_policy(capsys, gen_trace: Path) -> None:
    before = torch.get_num_threads()  # restored after: the worker's later files keep conftest's count
    torch.set_num_threads(2)
    try:
        code, _, err = atlas(capsys, "generate", "--prompt", "hi", "--backend", "null", "--max-tokens", "2")
        assert code == 0, err
        assert torch.get_num_threads() == 1  # not torch's default of one per core
        torch.set_num_threads(2)
        code, _, err = atlas(capsys, "replay", "verify", str(gen_trace), "--threads", "1")
        assert code == 0, err
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_atlas_llm_sizes_threads_by_the_policy() -> None:
    import atlas

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = atlas.LLM("atlas-tiny")
        assert llm.threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_generate_without_max_tokens_stops_at_16(capsys) -> None:
    code, out, err = atlas(capsys, "generate", "--prompt", "hi", "--backend", "null", "--ignore-eos",
                           "--max-seq-len", "512")
    assert code == 0, err
    assert "-> 16 tokens, finish_reason=length" in out


def test_prefill_align_is_a_flag_and_a_bad_one_names_its_ceiling(capsys, tmp_path: Path) -> None:
    from atlas.replay.codec import decode

    trace = tmp_path / "aligned.db"
    code, out, err = atlas(capsys, "generate", "--prompt", "hello there", "--backend", "null", "--max-tokens", "2",
                           "--prefill-align", "8", "--trace", str(trace))
    assert code == 0, err
    with sqlite3.connect(trace) as db:  # the run's recorded config has it, and the 11-token prompt ran as 8 + 3
        assert '"prefill_align": 8' in " ".join(str(r) for r in db.execute("select * from runs").fetchall())
        planned = [decode("step_planned", v, p)
                   for v, p in db.execute("select version, payload from events where kind = 'step_planned'")]
    assert list(planned[0]["fed"]) == [8] and list(planned[1]["fed"]) == [3]
    code, out, err = atlas(capsys, "generate", "--prompt", "hi", "--backend", "null", "--prefill-align", "100000")
    assert code != 0
    line = one_line(err)
    assert "prefill_align 100000" in line and "ceiling" in line


# finding 4: one-line errors, exit 2 for usage mistakes, --debug for tracebacks


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_backend_without_a_gpu_is_one_line_and_exit_2(capsys) -> None:
    for command in ("generate", "serve"):
        argv = [command, "--backend", "cuda"] + (["--prompt", "hi"] if command == "generate" else [])
        code, out, err = atlas(capsys, *argv)
        assert code == 2 and out == ""
        line = one_line(err)
        assert "--backend cuda" in line and "no CUDA GPU" in line and "--backend cpu" in line


def test_a_bad_tuning_names_the_knob_and_the_choices_before_any_gpu_check(capsys) -> None:
    code, out, err = atlas(capsys, "serve", "--backend", "cuda", "--tuning", "fastest")
    assert code == 2 and out == ""
    line = one_line(err)
    assert "--tuning 'fastest'" in line and "default" in line and "eager" in line
    code, _, err = atlas(capsys, "serve", "--tuning", "eager")  # the default backend is cpu
    assert code == 2
    line = one_line(err)
    assert "--tuning eager" in line and "--backend cpu" in line and "--backend cuda" in line


def test_serving_with_a_tuning_builds_that_arrangement_and_records_it(tmp_path: Path) -> None:
    """cuda-fp32 on CPU tensors (no GPU here): the backend the server builds holds the variant's knobs and the
    trace's run row records them, so a replay rebuilds the same arithmetic."""
    import attrs

    import atlas.server.serve as serve_module
    from atlas.backends.cuda.tuning import TUNINGS
    from atlas.replay.reader import TraceReader

    built: dict = {}
    real = serve_module.registry_build

    def on_cpu(model, backend, config, *, trace=None, backend_options=None, **kwargs):
        built["options"] = backend_options
        return real(model, backend, config, trace=trace,
                    backend_options={**backend_options, "device": "cpu", "cuda_graphs": False}, **kwargs)

    serve_module.registry_build = on_cpu
    try:
        engine = serve_module.engine_for_serving(None, backend="cuda-fp32", trace=str(tmp_path / "t.db"),
                                                 max_seq_len=64, max_batch_size=2, tuning="default")
    finally:
        serve_module.registry_build = real
    try:
        # named, the default arrangement even where the backend would fall back to the reference (CPU tensors)
        assert built["options"]["tuning"] == TUNINGS["default"]
        assert engine.backend.tuning == TUNINGS["default"]
    finally:
        engine.close()
    reader = TraceReader(tmp_path / "t.db")
    try:
        assert reader.run().config["backend_tuning"] == attrs.asdict(TUNINGS["default"])
    finally:
        reader.close()


def test_a_bad_drafter_names_the_knob_and_the_choices(capsys) -> None:
    code, _, err = atlas(capsys, "generate", "--prompt", "hi", "--num-drafts", "2", "--drafter", "eagle")
    assert code == 2
    line = one_line(err)
    assert "--drafter 'eagle'" in line and "mtp" in line and "ngram" in line


def test_a_missing_trace_file_is_one_line_for_every_reader(capsys, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.db")
    for argv in (["trace", "show", missing], ["replay", "verify", missing], ["replay", "against", missing],
                 ["replay", "check", missing], ["trace", "export", missing, "-o", str(tmp_path / "x.jsonl")]):
        code, _, err = atlas(capsys, *argv)
        assert code == 2, argv
        assert missing in one_line(err) and "does not exist" in err
    assert not Path(missing).exists()  # and no empty store was created on the way


def test_an_unwritable_trace_path_is_named(capsys, tmp_path: Path) -> None:
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for target, why in ((tmp_path / "no" / "such" / "run.db", "does not exist"), (tmp_path, "is a directory"),
                        (a_file / "run.db", "does not exist")):
        code, _, err = atlas(capsys, "generate", "--prompt", "hi", "--backend", "null", "--trace", str(target))
        assert code == 2
        line = one_line(err)
        assert str(target) in line and why in line


def test_a_trace_path_sqlite_cannot_open_is_named(capsys) -> None:
    target = "/proc/atlas-cannot-write-here.db"  # writable by permission bits for root, refused by the kernel
    code, _, err = atlas(capsys, "generate", "--prompt", "hi", "--backend", "null", "--trace", target)
    assert code == 2
    assert target in one_line(err)


def test_a_port_in_use_is_a_usage_error_not_a_fault(capsys) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err = atlas(capsys, "serve", "--backend", "null", "--port", str(port))
    assert code == 2
    line = one_line(err)
    assert f"--port {port}" in line and "in use" in line


def test_parser_errors_are_one_line_with_exit_2(capsys) -> None:
    for argv in (["generate"], ["generate", "--prompt", "hi", "--max-tokens", "many"], ["generate", "--bogus"]):
        code, _, err = atlas(capsys, *argv)
        assert code == 2, argv
        assert "atlas generate" in one_line(err)


def test_debug_shows_the_traceback(capsys) -> None:
    with pytest.raises(Exception, match="drafter"):
        run(["generate", "--prompt", "hi", "--drafter", "eagle", "--debug"])
    capsys.readouterr()


# finding 5: checkpoints


def test_a_checkpoint_without_tokenizer_json_needs_an_explicit_byte_tokenizer(capsys, tiny_dir: Path) -> None:
    code, _, err = atlas(capsys, "generate", "--prompt", "hi", "--model", str(tiny_dir), "--max-tokens", "2")
    assert code == 2
    line = one_line(err)
    assert "tokenizer.json" in line and "--tokenizer byte" in line
    # max_seq_len: generate's 1024 is lowered to the model's 512 instead of refusing the checkpoint
    code, out, err = atlas(capsys, "generate", "--prompt", "hi", "--model", str(tiny_dir), "--max-tokens", "2",
                           "--tokenizer", "byte")
    assert code == 0, err
    assert "-> 2 tokens" in out


def test_a_hub_id_says_to_pass_a_directory(capsys) -> None:
    code, _, err = atlas(capsys, "generate", "--prompt", "hi", "--model", "Qwen/Qwen3-0.6B")
    assert code == 2
    line = one_line(err)
    assert "Qwen/Qwen3-0.6B" in line and "--model DIR" in line and "download" in line


def test_max_seq_len_defaults_to_the_models_limit_when_smaller(tiny_dir: Path) -> None:
    from atlas.cli_checks import UsageError, default_max_seq_len

    assert default_max_seq_len(str(tiny_dir), None) == 512  # not EngineConfig's 4096
    assert default_max_seq_len("atlas-tiny", None) == 4096
    assert default_max_seq_len(str(tiny_dir), 256) == 256
    with pytest.raises(UsageError, match="--max-seq-len 1000 exceeds the model's max_position_embeddings 512"):
        default_max_seq_len(str(tiny_dir), 1000)


def test_serve_a_checkpoint_under_a_served_model_name_at_the_models_limit(tiny_dir: Path, tmp_path: Path) -> None:
    """The README's curl names the model; a checkpoint dir served as `atlas-tiny` must answer to that name, and a
    model whose max_position_embeddings (512) is below the default max_seq_len must be served, not refused."""
    import httpx
    from fixtures.serving import ServeProcess

    with ServeProcess(tmp_path, "--model", str(tiny_dir), "--tokenizer", "byte", "--served-model-name",
                      "atlas-tiny") as served:
        url = served.wait_ready().url
        card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        assert card["id"] == "atlas-tiny" and card["max_model_len"] == 512
        r = httpx.post(f"{url}/v1/completions", json={"model": "atlas-tiny", "prompt": "Hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.post(f"{url}/v1/completions", json={"model": "tiny-512", "prompt": "Hello"},
                          timeout=60).status_code == 404


def test_the_gpu_benchmark_command_fails_clearly_without_a_gpu(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    code, out, err = atlas(capsys, "bench", "gpu", "--out", "/tmp/atlas-bench-nowhere")
    assert code == 2 and out == ""
    assert "needs a CUDA GPU" in one_line(err)
    code, _, err = atlas(capsys, "bench", "gpu", "--config", "/nonexistent/config.json")
    assert code == 2 and "--config" in one_line(err)


def test_bench_serve_reports_progress_per_request() -> None:
    from atlas.server.bench import BenchConfig, bench_serve

    seen: list[tuple[int, int]] = []
    cfg = BenchConfig(base_url="", num_prompts=5, input_len=8, output_len=2, max_concurrency=2)
    result = bench_serve(cfg, launch={"model": None, "backend": "null", "max_seq_len": 64, "max_batch_size": 4},
                         progress=lambda done, total: seen.append((done, total)), threads=1)
    assert result["completed"] == 5
    assert seen == [(n, 5) for n in range(1, 6)]


# finding 6: replay against on a healthy generate trace


def test_replay_against_calls_a_healthy_generate_trace_identical(capsys, gen_trace: Path) -> None:
    code, out, err = atlas(capsys, "replay", "against", str(gen_trace))
    assert code == 0, err
    assert "identical: " in out and "past the trace's end" not in out
    assert "outcome: passes" in out
    replayed, expected = out.split("replayed ", 1)[1].split(" events")[0], out.split("(trace: ")[1].split(")")[0]
    assert replayed == expected


def test_replay_against_reports_progress(gen_trace: Path) -> None:
    from atlas.replay.against import against

    seen: list[tuple[int, int]] = []
    report = against(gen_trace, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1] == (report.events_expected, report.events_expected)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


# finding 7: output


def _fresh_process(*args: str) -> subprocess.CompletedProcess[str]:
    """A new interpreter: logging is configured as a user's process finds it, not as earlier tests left it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env)


def test_replay_verify_prints_only_its_result_on_stdout(gen_trace: Path) -> None:
    out = _fresh_process("-c", "from atlas.cli import main; main()", "replay", "verify", str(gen_trace))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [out.stdout.strip()] and out.stdout.startswith("identical: ")
    assert "capacities derived" in out.stderr  # the log lines are on stderr


def test_atlas_llm_keeps_stdout_for_the_callers_results() -> None:
    code = ("import atlas; r = atlas.LLM('atlas-tiny').generate(['hi'], atlas.SamplingParams(max_tokens=2)); "
            "print('RESULT', len(r[0].token_ids))")
    out = _fresh_process("-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "RESULT 2\n"
    assert "capacities derived" in out.stderr


def test_the_mtp_drafter_context_line_is_logged_only_for_the_mtp_drafter(capsys) -> None:
    base = ["generate", "--prompt", "hi", "--max-tokens", "2"]
    for extra, expected in (([], False), (["--num-drafts", "2", "--drafter", "ngram"], False),
                            (["--num-drafts", "2", "--drafter", "mtp"], True)):
        code, _, err = atlas(capsys, *base, *extra)
        assert code == 0, err
        assert ("MTP drafter context" in err) is expected, extra


def test_help_has_no_type_labels_and_serve_documents_its_sizes(capsys) -> None:
    code, out, _ = atlas(capsys, "generate", "--help")
    assert code == 0
    for label in ("<int>", "<str>", "<list[str]>", "<float>", "<bool>", "INTEGER"):
        assert label not in out
    assert "--max-tokens N" in out and "[default: 16]" in out
    code, out, _ = atlas(capsys, "serve", "--help")
    flat = " ".join(out.split())
    assert "--max-seq-len, --max-model-len N longest prompt + completion" in flat and "4096" in flat
    assert "--max-batch-size, --max-num-seqs N sequences decoded together (default: 64)" in flat


def test_trace_show_prints_config_as_a_table_and_keeps_a_letter_fingerprint(capsys, gen_trace: Path,
                                                                           tmp_path: Path) -> None:
    trace = tmp_path / "copy.db"
    trace.write_bytes(gen_trace.read_bytes())
    con = sqlite3.connect(trace)
    con.execute("update runs set model_fingerprint = 'dbe7a1c2f00d5eed' || substr(model_fingerprint, 17)")
    con.commit()
    con.close()
    code, out, err = atlas(capsys, "trace", "show", str(trace))
    assert code == 0, err
    assert "[dbe7a1c2f00d5eed]" in out
    assert "{'max_seq_len'" not in out and "'prefill_chunk_tokens':" not in out
    rows = [line for line in out.splitlines() if "max_seq_len" in line]
    assert rows and "1024" in rows[0]  # a config row: key and value


def test_trace_show_per_position_acceptance_counts_the_committed_chain(capsys, tmp_path: Path) -> None:
    """Three verifies whose first two rows reject and whose third row agrees: 0 drafts accepted, and no
    position may claim an acceptance (today's line read `by position [0.0, 0.0, 1.0]`)."""
    from atlas.replay.store import TraceWriter
    from atlas.replay.summary import summarize

    trace = tmp_path / "spec.db"
    config = {"num_drafts": 3, "drafter": "mtp"}
    writer = TraceWriter(trace, run={"engine_version": "t", "git_revision": None, "model": "atlas-tiny",
                                     "model_fingerprint": "f" * 64, "backend": "cpu", "seed": None,
                                     "config": config, "capacities": {}})
    rows = [(0, "request_arrived", {"request_id": "r", "seq_id": 0, "prompt": [1, 2], "params": {}, "max_new": 9})]
    for step in range(3):
        rows += [(step, "step_planned", {"step": step, "admitted": [], "seqs": [0], "fed": [1], "alloc": [],
                                         "release": [], "reset": [], "drafts": [[5, 6, 7]]}),
                 (step, "step_executed", {"step": step, "tokens": [9], "accepted": [0], "verdicts": [0b100]})]
    for index, (step, kind, payload) in enumerate(rows):  # whole events (a reader checks each), as the engine writes
        writer._rows.append({"run_id": writer.run_id, "idx": index, "step": step, "kind": kind, "version": 2,
                             "payload": json.dumps(payload), "digest": "0" * 16})
    writer.close()
    sp = summarize(trace).speculation
    assert sp is not None and sp["drafts_accepted"] == 0
    assert sp["p_by_position"] == [0.0, 0.0, 0.0] and sp["accepted_by_position"] == [0, 0, 0]
    code, out, err = atlas(capsys, "trace", "show", str(trace))
    assert code == 0, err
    assert "0/9 drafts accepted" in out
    position_3 = next(line for line in out.splitlines() if line.strip("│┃ ").startswith("3 "))
    cells = [c.strip() for c in position_3.strip("│┃").split("│")]
    assert cells[:4] == ["3", "3", "0", "0.0000"], cells  # drafted 3 times, accepted 0 in the chain
