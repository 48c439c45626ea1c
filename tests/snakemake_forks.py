"""Snakemake command lines run with Snakemake imported once.

`python tests/snakemake_forks.py` imports Snakemake's command line (about 2 s of CPU on the CI machine: its
executor plugins pull in pandas and the Kubernetes client), then reads one JSON request a line on stdin: the
arguments, working directory, environment and two output files. For each it forks a child that runs
`snakemake.cli.main(args)`, exactly what the `snakemake` script runs, and answers with the child's exit code. The
suite makes several hundred Snakemake calls, most of them dry runs that take less time than the imports.
"""

from __future__ import annotations

import json
import os
import sys

import snakemake.cli


def run_child(request: dict) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests stay the server's
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.argv = [request["argv0"], *request["args"]]
    code = 0
    try:
        snakemake.cli.main(request["args"])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException as err:  # noqa: BLE001 - anything else is the command's failure, reported as such
        print(f"snakemake_forks: {type(err).__name__}: {err}", file=sys.stderr)
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request)
        _, status, usage = os.wait4(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status),
                          "cpu_seconds": usage.ru_utime + usage.ru_stime}), flush=True)


if __name__ == "__main__":
    serve()
