"""`python -m perf`: list the benchmarks; `python -m perf <name> [args...]`: run one."""

import sys

from perf import listing, run

if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help", "list"):
    print(listing())
else:
    run(sys.argv[1], sys.argv[2:])
