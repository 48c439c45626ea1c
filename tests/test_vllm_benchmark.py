"""The vllm benchmark backend: the command and speculative config it builds, the Prometheus parser on
vLLM 0.16's own metric text, and the run/stop logic against a stand-in HTTP server (vllm serve itself
needs a GPU): the same endpoints (/health, /metrics, /v1/chat/completions) and counter names."""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
import time

import pandas as pd
import pytest

from draftsmith.benchmark.prometheus import counter_delta, parse_prometheus, spec_decode_counters
from draftsmith.benchmark.results import COLUMNS, accept_columns
from draftsmith.benchmark.vllm_benchmark import BASELINE_FILE, OUTPUTS_BY_SIZE_FILE, OUTPUTS_FILE, run_vllm_benchmark
from draftsmith.benchmark.vllm_server import (
    ServerError,
    VllmServer,
    check_cpu_test_worker,
    free_port,
    root_cause,
    serve_command,
    speculative_config,
)
from draftsmith.config.workflow import section_defaults
from draftsmith.target_model.spec import TargetSpec

# What vLLM 0.16's /metrics serves for spec decoding (SpecDecodingProm through prometheus_client, labels
# model_name and engine; generated with vllm.v1.spec_decode.metrics), for two engines (data parallel),
# between other vLLM metrics.
VLLM_METRICS = textwrap.dedent('''\
    # HELP vllm:num_requests_running Number of requests in model execution batches.
    # TYPE vllm:num_requests_running gauge
    vllm:num_requests_running{engine="0",model_name="target"} 0.0
    # HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
    # TYPE vllm:spec_decode_num_drafts_total counter
    vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 4.0
    vllm:spec_decode_num_drafts_total{engine="1",model_name="target"} 6.0
    # HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
    # TYPE vllm:spec_decode_num_drafts_created gauge
    vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.796227567847812e+09
    vllm:spec_decode_num_drafts_created{engine="1",model_name="target"} 1.796227567847812e+09
    # HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
    # TYPE vllm:spec_decode_num_draft_tokens_total counter
    vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 12.0
    vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="target"} 18.0
    # HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
    # TYPE vllm:spec_decode_num_accepted_tokens_total counter
    vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 6.0
    vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="target"} 9.0
    # HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
    # TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 3.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 2.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 1.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="0"} 5.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="1"} 3.0
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="2"} 1.0
    # HELP vllm:spec_decode_num_accepted_tokens_per_pos_created Accepted tokens per draft position.
    # TYPE vllm:spec_decode_num_accepted_tokens_per_pos_created gauge
    vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="target",position="0"} 1.7962275678480031e+09
    # HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
    # TYPE vllm:e2e_request_latency_seconds histogram
    vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="target"} 0.0
    vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="target"} 2.0
    vllm:e2e_request_latency_seconds_count{engine="0",model_name="target"} 2.0
    python_info{implementation="CPython",major="3",minor="11",patchlevel="9",version="3.11.9"} 1.0
    process_max_fds 20000.0
    ''')

CFG = {**section_defaults("benchmark"), "backend": "vllm", "num_speculative_tokens": 3, "max_new_tokens": 16, "temperature": 0.0, "concurrency": 1, "seed": 0,
       "server_timeout_s": 60}


def test_serve_command_and_speculative_config():
    cmd = serve_command(TargetSpec("org/target", revision="abc", trust_remote_code=True), CFG, 8123, "results/draft/default")
    assert cmd[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "org/target"]
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"model": "results/draft/default", "num_speculative_tokens": 3, "method": "eagle3"}
    assert spec == speculative_config("results/draft/default", 3)
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("--revision") + 1] == "abc"
    assert "--trust-remote-code" in cmd and cmd[cmd.index("--generation-config") + 1] == "vllm"
    baseline = serve_command(TargetSpec("org/target"), CFG, 8123)
    assert "--speculative-config" not in baseline and "--trust-remote-code" not in baseline


def test_the_cpu_test_worker_serves_the_draft_eagerly_without_the_padded_drafter_batch():
    cfg = {**CFG, "cpu_test_worker": True}
    cmd = serve_command(TargetSpec("org/target"), cfg, 8123, "d")
    assert cmd[cmd.index("--worker-cls") + 1] == "draftsmith.vllm_stack.cpu_spec_worker.CPUSpecDecodeWorker"
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {**speculative_config("d", 3),
                                                                      "disable_padded_drafter_batch": True}
    assert "--enforce-eager" in cmd
    baseline = serve_command(TargetSpec("org/target"), cfg, 8123)  # vLLM's own CPU worker serves the target alone
    assert "--enforce-eager" in baseline and "--worker-cls" not in baseline
    plain = serve_command(TargetSpec("org/target"), CFG, 8123, "d")
    assert "--worker-cls" not in plain and "--enforce-eager" not in plain


def test_the_cpu_test_worker_is_an_error_where_a_gpu_is_visible():
    check_cpu_test_worker({**CFG, "cpu_test_worker": True}, gpus=0)
    check_cpu_test_worker(CFG, gpus=8)
    with pytest.raises(ValueError, match=r"cpu_test_worker: true, but 2 GPU\(s\) are visible.*set benchmark.cpu_test_worker: false"):
        check_cpu_test_worker({**CFG, "cpu_test_worker": True}, gpus=2)


def test_vllm_own_cli_parser_accepts_the_command(monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed; the command is checked by structure only")
    import vllm.platforms
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setattr(vllm.platforms, "_current_platform", CpuPlatform())  # the parser builds default configs
    cmd = serve_command(TargetSpec("org/target", trust_remote_code=True),
                        {**CFG, "tensor_parallel_size": 2, "max_model_len": 4096}, 8123, "d")
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[4:])
    engine = AsyncEngineArgs.from_cli_args(args)
    assert args.model_tag == "org/target" and args.port == 8123 and args.served_model_name == ["target"]
    assert engine.speculative_config == speculative_config("d", 3)
    assert engine.tensor_parallel_size == 2 and engine.max_model_len == 4096 and engine.trust_remote_code
    test_worker = serve_command(TargetSpec("org/target"), {**CFG, "cpu_test_worker": True}, 8123, "d")
    engine = AsyncEngineArgs.from_cli_args(make_arg_parser(FlexibleArgumentParser()).parse_args(test_worker[4:]))
    assert engine.worker_cls == "draftsmith.vllm_stack.cpu_spec_worker.CPUSpecDecodeWorker" and engine.enforce_eager
    assert engine.speculative_config["disable_padded_drafter_batch"] is True


def test_prometheus_parser_on_vllm_metrics():
    samples = parse_prometheus(VLLM_METRICS)
    assert samples[("vllm:spec_decode_num_drafts_total", (("engine", "1"), ("model_name", "target")))] == 6.0
    assert samples[("vllm:e2e_request_latency_seconds_bucket",
                    (("engine", "0"), ("le", "+Inf"), ("model_name", "target")))] == 2.0
    assert samples[("process_max_fds", ())] == 20000.0
    counters = spec_decode_counters(VLLM_METRICS, 3)
    assert counters == {"drafts": 10.0, "draft_tokens": 30.0, "accepted": 15.0, "accepted_per_pos": [8.0, 5.0, 2.0]}
    assert 1 + counters["accepted"] / counters["drafts"] == 2.5  # vLLM's mean acceptance length


def test_prometheus_parser_on_text_vllm_generates():
    pytest.importorskip("vllm", reason="vLLM is not installed; the parser is checked on the recorded text only")
    from types import SimpleNamespace

    import prometheus_client
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    registry = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter

    class RegistryCounter(counter):  # vLLM registers on the default registry; keep this test's counters apart
        def __init__(self, *args, **kwargs):
            super().__init__(*args, registry=registry, **kwargs)

    prom = type("Prom", (SpecDecodingProm,), {"_counter_cls": RegistryCounter})(
        SimpleNamespace(num_speculative_tokens=3), ["model_name", "engine"], {0: ["target", "0"]})
    stats = SpecDecodingStats.new(3)
    for accepted in (3, 1, 0, 2):
        stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=accepted)
    prom.observe(stats, 0)
    text = prometheus_client.generate_latest(registry).decode()
    assert spec_decode_counters(text, 3) == {"drafts": 4.0, "draft_tokens": 12.0, "accepted": 6.0,
                                             "accepted_per_pos": [3.0, 2.0, 1.0]}


def test_counter_delta():
    before = {"drafts": 4.0, "draft_tokens": 12.0, "accepted": 6.0, "accepted_per_pos": [3.0, 2.0, 1.0]}
    after = {"drafts": 9.0, "draft_tokens": 27.0, "accepted": 10.0, "accepted_per_pos": [6.0, 3.0, 1.0]}
    assert counter_delta(after, before) == {"drafts": 5.0, "draft_tokens": 15.0, "accepted": 4.0,
                                            "accepted_per_pos": [3.0, 1.0, 0.0]}


# ----------------------------------------------------------------------------- against a stand-in server

STAND_IN = textwrap.dedent('''\
    """Serves vllm serve's endpoints: each completion adds (2 + prompt index) drafts of 3 tokens to the counters."""
    import json, subprocess, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    port, mode, pidfile = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    child = subprocess.Popen(["sleep", "600"])  # a worker process, as vllm serve has
    open(pidfile, "w").write(str(child.pid))
    counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "pos": [0, 0, 0]}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, code, body, kind="application/json"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self.reply(200, "")
            lines = []
            if mode != "base":
                with lock:
                    lines.append(f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="target"}} {counters["drafts"]}.0')
                    lines.append(f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="target"}} {counters["draft_tokens"]}.0')
                    lines.append(f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="target"}} {counters["accepted"]}.0')
                    for i, v in enumerate(counters["pos"]):
                        lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="target",position="{i}"}} {v}.0')
            self.reply(200, "\\n".join(lines) + "\\n", "text/plain")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if mode == "fail":
                return self.reply(500, '{"error": "boom"}')
            assert body["temperature"] == 0.0 and body["model"] == "target"
            index = int(body["messages"][-1]["content"].split()[-1]) if body["messages"][-1]["content"][-1].isdigit() else 0
            if mode.startswith("spec"):
                with lock:
                    drafts = 2 + index
                    counters["drafts"] += drafts
                    counters["draft_tokens"] += 3 * drafts
                    counters["accepted"] += drafts  # one accepted token per draft, at position 0
                    counters["pos"][0] += drafts
            usage = {"prompt_tokens": 5 + index, "completion_tokens": body["max_tokens"]}
            tokens = [index + t for t in range(body["max_tokens"])]  # return_token_ids: the generated ids
            if mode == "spec_differs" and index == 1:
                tokens[-1] += 1  # this draft's server changes one prompt's output
            choice = {"message": {"content": "x"}, "token_ids": tokens if body.get("return_token_ids") else None}
            self.reply(200, json.dumps({"choices": [choice], "usage": usage}))

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    ''')


@pytest.fixture
def stand_in(tmp_path):
    script = tmp_path / "stand_in_server.py"
    script.write_text(STAND_IN)
    pidfiles = []

    def make_command(mode=None, draft_mode="spec"):
        def command(target, cfg, port, draft_dir=None):
            pidfiles.append(tmp_path / f"child_{len(pidfiles)}.pid")
            return [sys.executable, str(script), str(port), mode or (draft_mode if draft_dir else "base"), str(pidfiles[-1])]
        return command

    make_command.pidfiles = pidfiles
    return make_command


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its dead parent) counts as stopped
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    except OSError:
        return False


def wait_dead(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


PROMPTS = [{"prompt_id": f"p{i}", "category": "all", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3)]


def test_benchmark_tables_and_per_prompt_acceptance(stand_in, tmp_path):
    out = tmp_path / "bench"
    summary = run_vllm_benchmark(TargetSpec("target"), "draft", PROMPTS, CFG, out / "per_prompt.csv", out / "summary.json", "default",
                                 make_command=stand_in())
    df = pd.read_csv(out / "per_prompt.csv")
    assert list(df.columns) == COLUMNS + accept_columns(3)
    assert sorted(set(df["method"])) == ["eagle3_draft", "target_greedy"] and len(df) == 6
    spec = df[df["method"] == "eagle3_draft"].set_index("prompt_id")
    assert spec.loc["p2", "drafts"] == 4 and spec.loc["p2", "draft_tokens"] == 12 and spec.loc["p2", "accepted_tokens"] == 4
    assert spec.loc["p0", "target_forwards"] == 3 and spec.loc["p0", "accept_pos_1"] == 2 and spec.loc["p0", "accept_pos_2"] == 0
    assert spec.loc["p1", "acceptance_length"] == pytest.approx(16 / 4)
    assert (df[df["method"] == "target_greedy"]["acceptance_length"] == 1.0).all()
    written = json.loads((out / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary, default=str))
    assert written["backend"] == "vllm" and written["num_speculative_tokens"] == 3 and written["num_prompts"] == 3
    methods = written["methods"]
    assert methods["eagle3_draft"]["per_position_acceptance"] == [1.0, 0.0, 0.0]
    assert methods["eagle3_draft"]["tokens_per_drafted_round"] == pytest.approx(1 + spec["accepted_tokens"].sum() / 9)
    # one acceptance-length definition: tokens per target forward (16 new tokens over 1 prefill + 9 drafts)
    assert "mean_acceptance_length_counters" not in methods["eagle3_draft"] and "acceptance_length" in written
    assert methods["eagle3_draft"]["acceptance_length"] == pytest.approx(48 / (3 + 9))
    assert written["device"].startswith("cpu: ") and written["device"].endswith("(vllm serve)")  # no GPU here
    assert methods["target_greedy"]["speedup"] == 1.0 and methods["eagle3_draft"]["new_tokens"] == 48
    assert (out / "vllm_serve_eagle3_draft.log").exists()
    assert all(wait_dead(int(p.read_text())) for p in stand_in.pidfiles)  # both servers' process groups are gone


def test_the_drafts_output_is_compared_with_the_target_only_output(stand_in, tmp_path):
    same = run_vllm_benchmark(TargetSpec("target"), "draft", PROMPTS, CFG, tmp_path / "a" / "pp.csv", tmp_path / "a" / "s.json",
                              "default", make_command=stand_in())
    assert same["methods"]["eagle3_draft"]["lossless"] is True and same["methods"]["eagle3_draft"]["mismatched_prompts"] == []
    outputs = json.loads((tmp_path / "a" / OUTPUTS_FILE).read_text())
    assert outputs["eagle3_draft"] == outputs["target_greedy"] and outputs["target_greedy"]["p2"] == list(range(2, 18))
    differs = run_vllm_benchmark(TargetSpec("target"), "draft", PROMPTS, CFG, tmp_path / "b" / "pp.csv",
                                 tmp_path / "b" / "s.json", "default", make_command=stand_in(draft_mode="spec_differs"))
    assert differs["methods"]["eagle3_draft"]["lossless"] is False
    assert differs["methods"]["eagle3_draft"]["mismatched_prompts"] == ["p1"]


def test_concurrent_requests_report_aggregate_acceptance(stand_in, tmp_path):
    cfg = {**CFG, "concurrency": 3}
    summary = run_vllm_benchmark(TargetSpec("target"), "draft", PROMPTS, cfg, tmp_path / "pp.csv", tmp_path / "s.json", "default",
                                 make_command=stand_in())
    spec = summary["methods"]["eagle3_draft"]
    assert spec["counters"]["drafts"] == 2 + 3 + 4
    assert spec["acceptance_length"] == pytest.approx(48 / (3 + 9))
    assert spec["per_position_acceptance"] == [1.0, 0.0, 0.0]
    assert spec["tokens_per_drafted_round"] == pytest.approx(1 + spec["counters"]["accepted"] / 9)
    assert spec["tokens_per_s"] == pytest.approx(48 / spec["wall_seconds"])
    rows = pd.read_csv(tmp_path / "pp.csv")
    assert rows[rows["method"] == "eagle3_draft"]["drafts"].isna().all()  # not separable per request
    assert not math.isnan(summary["methods"]["target_greedy"]["speedup"])


def test_a_sweep_runs_every_size_on_one_server_per_method_and_its_counters_add_up(stand_in, tmp_path):
    cfg = {**CFG, "batch_sizes": [1, 2, 4]}
    out = tmp_path / "bench"
    summary = run_vllm_benchmark(TargetSpec("target"), "draft", PROMPTS, cfg, out / "pp.csv", out / "summary.json",
                                 "default", make_command=stand_in())
    assert len(stand_in.pidfiles) == 2, "one server per method, each running every size"
    assert summary["batch_sizes"] == [1, 2, 4]
    rows = pd.read_csv(out / "pp.csv")
    assert list(rows.columns) == COLUMNS + accept_columns(3)
    assert rows.groupby(["batch_size", "method"]).size().to_dict() == {(s, m): 3 for s in (1, 2, 4)
                                                                       for m in ("eagle3_draft", "target_greedy")}
    spec = summary["methods"]["eagle3_draft"]
    per_size = spec["per_batch_size"]
    assert list(per_size) == ["1", "2", "4"] and list(summary["methods"]["target_greedy"]["per_batch_size"]) == ["1", "2", "4"]
    for size, entry in per_size.items():
        greedy = summary["methods"]["target_greedy"]["per_batch_size"][size]
        assert entry["speedup"] == pytest.approx(entry["tokens_per_s"] / greedy["tokens_per_s"])
        assert greedy["speedup"] == pytest.approx(1.0) and greedy["acceptance_length"] == 1.0
        # the stand-in's counters: 2 + i drafts for prompt i, whatever the size
        assert entry["counters"]["drafts"] == 2 + 3 + 4 and entry["acceptance_length"] == pytest.approx(48 / (3 + 9))
        assert entry["in_flight"] == min(int(size), 3) and entry["lossless"] is True
    # size 1: each request's own counters add up to the size's; above it they cannot be split by request
    at_1 = rows[(rows["batch_size"] == 1) & (rows["method"] == "eagle3_draft")]
    assert per_size["1"]["requests_add_up"] is True and per_size["1"]["per_request_counters"]["drafts"] == at_1["drafts"].sum()
    assert per_size["2"]["requests_add_up"] is None and rows[rows["batch_size"] == 2]["drafts"].isna().any()
    assert spec["sizes_add_up"] is True and spec["counters_all_sizes"]["drafts"] == 3 * 9
    # the top-level figures are the smallest size's; pays_up_to reads the per-size speedups
    assert spec["speedup"] == per_size["1"]["speedup"] and spec["counters"] == per_size["1"]["counters"]
    speedups = [per_size[s]["speedup"] for s in ("1", "2", "4")]
    beats = [s > 1 for s in speedups]
    expected = None if not beats[0] else [1, 2, 4][beats.index(False) - 1] if False in beats else 4
    assert spec["pays_up_to"] == expected and "pays_up_to" not in summary["methods"]["target_greedy"]
    by_size = json.loads((out / OUTPUTS_BY_SIZE_FILE).read_text())
    assert list(by_size) == ["1", "2", "4"] and by_size["4"] == json.loads((out / OUTPUTS_FILE).read_text())


def test_the_server_holds_the_largest_size_without_prefix_caching():
    cmd = serve_command(TargetSpec("org/target"), {**CFG, "batch_sizes": [1, 4, 16]}, 8123)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "16" and "--no-enable-prefix-caching" in cmd
    one = serve_command(TargetSpec("org/target"), {**CFG, "concurrency": 3}, 8123)
    assert one[one.index("--max-num-seqs") + 1] == "3"


def test_pays_up_to_is_the_largest_size_up_to_which_the_draft_beats_greedy():
    from draftsmith.benchmark.results import pays_up_to

    def sizes(*speedups):
        return {str(s): {"speedup": x} for s, x in zip([1, 4, 16, 64], speedups)}

    assert pays_up_to(sizes(1.5, 1.2, 0.9, 0.7)) == 4
    assert pays_up_to(sizes(1.5, 1.2, 1.1, 1.01)) == 64
    assert pays_up_to(sizes(0.95, 1.2)) is None  # not at the smallest: it never paid from the start
    assert pays_up_to(sizes(1.3, 0.9, 1.1)) == 1  # up to: a later size above 1 does not bridge the gap
    assert pays_up_to(sizes(1.3, float("nan"))) == 1 and pays_up_to({}) is None


def test_server_is_stopped_when_the_run_fails(stand_in, tmp_path):
    with pytest.raises(ServerError, match="chat completion failed \\(500\\)"):
        run_vllm_benchmark(TargetSpec("target"), "draft", PROMPTS, CFG, tmp_path / "pp.csv", tmp_path / "s.json", "default",
                           make_command=stand_in("fail"))
    assert wait_dead(int(stand_in.pidfiles[0].read_text()))
    assert not (tmp_path / "s.json").exists()


def test_server_that_exits_reports_the_end_of_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('ValueError: Eagle3 is only supported for llama'); sys.exit(3)"]
    with pytest.raises(ServerError, match="(?s)exited with code 3.*Eagle3 is only supported"):
        with VllmServer(cmd, free_port(), tmp_path / "serve.log", timeout_s=30):
            pass


# How vllm serve 0.16 logs an engine that dies at start-up (the CPU worker refusing a speculative config)
ENGINE_LOG = """\
(APIServer pid=4200) INFO 12-03 06:00:00 [api_server.py:1] vLLM API server version 0.16.0
(EngineCore_DP0 pid=4242) ERROR 12-03 06:00:01 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=4242) ERROR 12-03 06:00:01 [core.py:708] Traceback (most recent call last):
(EngineCore_DP0 pid=4242) ERROR 12-03 06:00:01 [core.py:708]   File "cpu_model_runner.py", line 40, in __init__
(EngineCore_DP0 pid=4242) ERROR 12-03 06:00:01 [core.py:708]     assert self.speculative_config is None
(EngineCore_DP0 pid=4242) ERROR 12-03 06:00:01 [core.py:708] AssertionError
(APIServer pid=4200) Traceback (most recent call last):
(APIServer pid=4200)   File "vllm", line 8, in <module>
(APIServer pid=4200) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_root_cause_is_the_engine_exception_not_the_api_server_wrapper():
    assert root_cause(ENGINE_LOG) == "AssertionError at `assert self.speculative_config is None`"
    assert root_cause("Traceback (most recent call last):\n  File 'x'\nValueError: bad\n") == "ValueError: bad"
    assert root_cause("INFO all fine\n") is None


def test_draft_server_failure_keeps_the_target_only_run_for_the_rerun(stand_in, tmp_path):
    script = tmp_path / "engine_dies.py"
    script.write_text(f"import sys\nprint({ENGINE_LOG!r}, end='')\nsys.exit(1)\n")
    working = stand_in()

    def draft_dies(target, cfg, port, draft_dir=None):
        return [sys.executable, str(script)] if draft_dir else working(target, cfg, port, draft_dir)

    out = tmp_path / "bench"
    args = (TargetSpec("target"), "draft", PROMPTS, CFG, out / "per_prompt.csv", out / "summary.json", "default")
    with pytest.raises(ServerError, match="(?s)root cause: AssertionError at `assert self.speculative_config is None`"
                                          ".*target-only run is kept"):
        run_vllm_benchmark(*args, make_command=draft_dies)
    assert not (out / "summary.json").exists() and (out / BASELINE_FILE).exists()
    started = len(stand_in.pidfiles)
    summary = run_vllm_benchmark(*args, make_command=working)
    assert len(stand_in.pidfiles) == started + 1, "the rerun starts only the draft's server"
    assert summary["methods"]["target_greedy"]["prompts"] == 3 and summary["methods"]["eagle3_draft"]["prompts"] == 3
    changed = {**CFG, "max_new_tokens": 8}
    run_vllm_benchmark(TargetSpec("target"), "draft", PROMPTS, changed, out / "per_prompt.csv", out / "summary.json",
                       "default", make_command=working)
    assert len(stand_in.pidfiles) == started + 3, "other settings measure the target-only run again"


def test_the_report_says_where_a_swept_draft_stops_paying_and_plots_it(stand_in, tmp_path):
    """The report's load table, sentence and figure on the summary a real sweep (against the stand-in server) wrote."""
    import matplotlib.pyplot as plt

    from draftsmith.report.figures import speedup_by_batch_size_figure
    from draftsmith.report.load import load_batch_sizes, load_summaries
    from draftsmith.report.tables import load_findings, load_table

    out = tmp_path / "bench"
    run_vllm_benchmark(TargetSpec("target"), "draft", PROMPTS, {**CFG, "batch_sizes": [1, 2, 4]}, out / "pp.csv",
                       out / "summary.json", "default", make_command=stand_in())
    by_variant, _ = load_summaries([out / "summary.json"])
    batch = load_batch_sizes(by_variant)
    spec = by_variant["default"]["methods"]["eagle3_draft"]
    table = load_table(batch)
    assert list(table["method"]) == ["target_greedy"] * 3 + ["eagle3_draft"] * 3
    assert list(table["concurrency"]) == [1, 2, 4, 1, 2, 4]
    drafted = table[table["method"] == "eagle3_draft"]
    assert list(drafted["speedup"]) == [spec["per_batch_size"][s]["speedup"] for s in ("1", "2", "4")]
    [line] = load_findings(batch)
    assert line.startswith("`default` (vllm backend) under load: the trained draft ")
    speedup = {int(s): e["speedup"] for s, e in spec["per_batch_size"].items()}
    pays = spec["pays_up_to"]
    if pays is None:
        assert f"does not beat target-only greedy even at concurrency 1 ({speedup[1]:.2f}×)" in line
    elif pays == 4:
        assert "beats target-only greedy at every measured concurrency, up to 4" in line
    else:
        after = {1: 2, 2: 4}[pays]
        assert f"beats target-only greedy up to concurrency {pays} (" in line
        assert f"); at {after} it is {speedup[after]:.2f}×" in line
    fig = speedup_by_batch_size_figure(batch)
    [ax] = fig.axes
    assert [list(line.get_xdata()) for line in ax.lines[:1]] == [[1, 2, 4]]  # the draft's line over the three sizes
    assert list(ax.lines[0].get_ydata()) == [speedup[1], speedup[2], speedup[4]]
    assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.lines)  # target-only greedy: the dashed line at 1
    plt.close(fig)
    assert speedup_by_batch_size_figure(batch[batch["batch_size"] == 1]) is None  # one size: no empty axes
    assert load_findings(batch[batch["batch_size"] == 1]) == []  # one size: nothing to say about load
