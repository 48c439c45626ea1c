"""Cluster profiles: what the real executor plugins submit for our rules.

Every file of the DAG is created first, so that `snakemake -f TARGET` submits exactly one job.
SLURM: Snakemake runs with `--workflow-profile profiles/slurm` and the real
snakemake-executor-plugin-slurm builds each `sbatch` call; a fake `sbatch` on PATH (the cluster
boundary) records its argv and refuses the job, so the run ends at once. Kubernetes: the real
snakemake-executor-plugin-kubernetes builds each Job and posts it to a fake Kubernetes API server
on 127.0.0.1 that records the body and reports the job failed. Both need envs/plugins.lock.txt.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SNAKEMAKE, write_config

pytest.importorskip("snakemake_executor_plugin_slurm", reason="install envs/plugins.lock.txt for the profile tests")

SLURM_PROFILE = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
TRAINING_GPUS = 2

# A cluster run states its GPUs in the config (device `auto` would count the login node's GPUs).
CLUSTER_CONFIG = {"extraction": {"device": "cuda"}, "training": {"gpus": TRAINING_GPUS}, "benchmark": {"device": "cuda"}}

FAKE_SBATCH = """#!/bin/sh
# Records its argv (fields separated by 0x1f, calls by 0x1e) and refuses the job.
{ for arg in "$@"; do printf '%s\\037' "$arg"; done; printf '\\036'; } >> "$SBATCH_RECORD"
echo "sbatch: error: not submitted (test double)" >&2
exit 1
"""
# The plugin guesses the account with sacct when the profile names none: no account here.
FAKE_SACCT = "#!/bin/sh\nexit 0\n"


def materialise_dag(workdir: Path, snakefile: Path = REPO / "Snakefile") -> None:
    """Create every file of the DAG (same mtime), so that `-f TARGET` runs exactly one job."""
    proc = subprocess.run([SNAKEMAKE, "-s", str(snakefile), "--directory", str(workdir), "--configfile",
                           str(workdir / "config.yaml"), "--summary"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split("\t") for line in proc.stdout.splitlines()[1:] if line.strip()]
    assert rows, f"snakemake --summary listed no files:\n{proc.stdout}\n{proc.stderr[-2000:]}"
    paths = [Path(row[0]) if Path(row[0]).is_absolute() else workdir / row[0] for row in rows]
    for path in paths:
        if path.suffix:  # the DAG's directory outputs (the target, report figures) have no suffix
            path.parent.mkdir(parents=True, exist_ok=True)
            # JSON files parse (the workflow reads the shard manifests its jobs use before the first job starts)
            path.write_text("{}" if path.suffix == ".json" else "")
        else:
            path.mkdir(parents=True, exist_ok=True)
    for path in paths:
        os.utime(path, (1_700_000_000, 1_700_000_000))


@pytest.fixture(scope="module")
def slurm_calls(tmp_path_factory) -> dict[str, list[str]]:
    """rule name -> argv of the first sbatch call the SLURM plugin made for it."""
    workdir = tmp_path_factory.mktemp("slurm")
    write_config(workdir, CLUSTER_CONFIG)
    materialise_dag(workdir)
    bin_dir = workdir / "fakebin"
    bin_dir.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("sacct", FAKE_SACCT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    record = workdir / "sbatch.record"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SBATCH_RECORD": str(record)}
    # Downstream first: Snakemake deletes the outputs of a failed job, which later jobs here need.
    targets = {
        "report": "results/report/report.html",
        "train_draft": "results/draft/default/config.json",
        "extract_hidden_states": "results/shards/synthetic/shard_0/manifest.json",
    }
    for rule, target in targets.items():
        proc = subprocess.run(
            [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--configfile",
             str(workdir / "config.yaml"), "--workflow-profile", str(REPO / "profiles" / "slurm"),
             # the faked files have no provenance, so only mtimes decide; one submission, no waiting
             "--rerun-triggers", "mtime", "--retries", "0", "--slurm-init-seconds-before-status-checks", "1",
             "-f", target],  # relative, as Snakemake spells a results tree under its working directory
            capture_output=True, text=True, env=env, timeout=300)
        assert "not submitted (test double)" in proc.stderr, f"{rule}: sbatch was not called:\n{proc.stderr[-6000:]}"
    calls: dict[str, list[str]] = {}
    for raw in record.read_text().split("\x1e"):
        if raw:
            argv = raw.split("\x1f")[:-1]
            comment = argv[argv.index("--comment") + 1]
            calls.setdefault(comment.removeprefix("rule_").split("_wildcards_")[0], argv)
    assert set(calls) == set(targets), f"sbatch calls recorded for {sorted(calls)}"
    return calls


def option(argv: list[str], name: str) -> str | None:
    """Value of `name` in argv, as `name value` or `name=value`; None when absent."""
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def expected(rule: str, key: str):
    return SLURM_PROFILE["set-resources"].get(rule, {}).get(key, SLURM_PROFILE["default-resources"].get(key))


def test_extraction_gets_one_gpu_per_shard_on_the_gpu_partition(slurm_calls):
    argv = slurm_calls["extract_hidden_states"]
    assert option(argv, "--gpus") == "1"
    assert option(argv, "-p") == expected("extract_hidden_states", "slurm_partition") == "gpu"
    assert option(argv, "-t") == str(expected("extract_hidden_states", "runtime"))
    assert option(argv, "--mem") == str(expected("extract_hidden_states", "mem_mb"))
    assert option(argv, "--cpus-per-task") == str(SLURM_PROFILE["set-threads"]["extract_hidden_states"])
    assert option(argv, "--ntasks") is None, "GPU jobs leave the task geometry to SLURM"
    wrapped = option(argv, "--wrap")
    assert "extract_hidden_states" in wrapped and "shard=0" in wrapped, wrapped


def test_training_gets_training_gpus_on_one_node(slurm_calls):
    argv = slurm_calls["train_draft"]
    assert option(argv, "--gpus") == str(TRAINING_GPUS)
    assert option(argv, "--nodes") == "1"
    assert option(argv, "-p") == "gpu"
    assert option(argv, "-t") == str(expected("train_draft", "runtime"))
    assert option(argv, "--mem") == str(expected("train_draft", "mem_mb"))
    assert option(argv, "--cpus-per-task") == str(SLURM_PROFILE["set-threads"]["train_draft"])


def test_report_is_cpu_only(slurm_calls):
    argv = slurm_calls["report"]
    assert option(argv, "--gpus") is None and option(argv, "--gres") is None
    assert option(argv, "-p") == expected("report", "slurm_partition") == "cpu"
    assert option(argv, "-t") == str(expected("report", "runtime"))
    assert option(argv, "--mem") == "4000", "the rule's own mem_mb (rules/report.smk)"
    assert option(argv, "--ntasks") == "1" and option(argv, "--cpus-per-task") == "1"


# --- Kubernetes ---------------------------------------------------------------------------------

K8S_PROFILE = yaml.safe_load((REPO / "profiles" / "kubernetes" / "config.yaml").read_text())

# The fs storage plugin copies with rsync; this machine may lack it, and only the workflow's
# source archive is copied here. Last two arguments: source, destination.
FAKE_RSYNC = """#!/bin/sh
for arg in "$@"; do src=$dst; dst=$arg; done
exec cp -R -p "$src" "$dst"
"""


class FakeKubernetesApi(BaseHTTPRequestHandler):
    """Accepts secrets and Jobs (recording each Job), then reports every Job failed."""

    jobs: list[dict] = []

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path.endswith("/jobs"):
            self.jobs.append(body)
        self.reply(201, body)

    def do_GET(self):
        if "/pods" in self.path:
            self.reply(200, {"kind": "PodList", "apiVersion": "v1", "items": []})
        elif "/jobs/" in self.path:
            name = self.path.split("/jobs/")[1].split("/")[0]
            self.reply(200, {"kind": "Job", "apiVersion": "batch/v1", "metadata": {"name": name}, "status": {"failed": 1}})
        else:
            self.reply(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404})

    def do_DELETE(self):
        self.reply(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def kubernetes_jobs(tmp_path_factory) -> dict[str, dict]:
    """rule name -> the Job the Kubernetes plugin posted for it (to a fake API server on 127.0.0.1)."""
    pytest.importorskip("snakemake_executor_plugin_kubernetes", reason="install envs/plugins.lock.txt")
    pytest.importorskip("snakemake_storage_plugin_fs", reason="install envs/plugins.lock.txt")
    workdir = tmp_path_factory.mktemp("kubernetes")
    # Pods get the workflow's sources from an archive of the files under the working directory.
    for name in ("Snakefile", "rules", "scripts", "config", "envs", "docs"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, workdir / name)
    config = write_config(workdir, CLUSTER_CONFIG)
    config.write_text(config.read_text().replace(str(workdir / "results"), "results"))
    materialise_dag(workdir, workdir / "Snakefile")
    storage = workdir / "bucket"
    storage.mkdir()
    shutil.move(workdir / "results", storage / "results")
    bin_dir = workdir / "fakebin"
    bin_dir.mkdir()
    (bin_dir / "rsync").write_text(FAKE_RSYNC)
    (bin_dir / "rsync").chmod(0o755)

    FakeKubernetesApi.jobs = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeKubernetesApi)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
        "users": [{"name": "fake", "user": {"token": "test"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
    }))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "KUBECONFIG": str(kubeconfig)}
    targets = {  # downstream first, as for SLURM
        "report": "results/report/report.html",
        "train_draft": "results/draft/default/config.json",
        "extract_hidden_states": "results/shards/synthetic/shard_0/manifest.json",
    }
    try:
        for rule, target in targets.items():
            proc = subprocess.run(
                [SNAKEMAKE, "--configfile", str(config), "--workflow-profile", str(REPO / "profiles" / "kubernetes"),
                 # a local directory stands in for the profile's bucket
                 "--default-storage-provider", "fs", "--default-storage-prefix", str(storage),
                 "--rerun-triggers", "mtime", "--retries", "0", "--seconds-between-status-checks", "1", "-f", target],
                cwd=workdir, capture_output=True, text=True, env=env, timeout=300)
            assert proc.returncode != 0 and "kubectl describe job" in proc.stderr, \
                f"{rule}: no Job was submitted:\n{proc.stderr[-6000:]}"
    finally:
        server.shutdown()
    jobs = {}
    for job in FakeKubernetesApi.jobs:
        args = job["spec"]["template"]["spec"]["containers"][0]["args"][-1]
        jobs.setdefault(args.split("--allowed-rules ")[1].split()[0], job)
    assert set(jobs) == set(targets), f"Jobs posted for {sorted(jobs)}"
    return jobs


def container(job: dict) -> dict:
    return job["spec"]["template"]["spec"]["containers"][0]


def test_kubernetes_extraction_pod_requests_and_limits_one_gpu(kubernetes_jobs):
    pod = container(kubernetes_jobs["extract_hidden_states"])
    assert pod["image"] == K8S_PROFILE["container-image"]
    requests, limits = pod["resources"]["requests"], pod["resources"]["limits"]
    assert requests["nvidia.com/gpu"] == limits["nvidia.com/gpu"] == "1", "Kubernetes needs GPU limits == requests"
    wanted = K8S_PROFILE["set-resources"]["extract_hidden_states"]
    assert requests["memory"] == limits["memory"] == f"{wanted['mem_mb']}M"
    assert requests["ephemeral-storage"] == f"{wanted['disk_mb']}M"
    assert limits["cpu"] == f"{K8S_PROFILE['set-threads']['extract_hidden_states'] * 1000}m"
    tolerations = kubernetes_jobs["extract_hidden_states"]["spec"]["template"]["spec"]["tolerations"]
    assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)


def test_kubernetes_training_pod_gets_training_gpus(kubernetes_jobs):
    resources = container(kubernetes_jobs["train_draft"])["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == str(TRAINING_GPUS)


def test_kubernetes_report_pod_asks_for_no_gpu(kubernetes_jobs):
    resources = container(kubernetes_jobs["report"])["resources"]
    assert int(resources["requests"].get("nvidia.com/gpu", 0)) == 0
    assert int(resources["limits"].get("nvidia.com/gpu", 0)) == 0
    assert resources["requests"]["memory"] == "4000M", "the rule's own mem_mb (rules/report.smk)"
