"""`draftsmith` command line: the parts of the pipeline users reach for outside Snakemake."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from draftsmith.io import forcerun_hint, read_json


def cmd_validate(args) -> int:
    from draftsmith.config.workflow import ConfigError, load_config
    from draftsmith.fingerprints import recorded_run
    from draftsmith.validate import validate_results, write_findings

    configfiles, workdir = args.config, None
    results = args.results
    try:
        run = recorded_run(results) if results else None
        if not configfiles:  # the config files the tree's last run was given (draftsmith.fingerprints.record_run)
            if run is None:
                raise ConfigError(f"{results or 'no results directory given'}: no record of the config the tree was "
                                  "made with (.draftsmith/run.json); name it: "
                                  "draftsmith validate RESULTS --config FILE ...")
            configfiles = run["configfiles"]
        config = load_config(configfiles)
        run = run or recorded_run(config["results"])
        workdir = (run or {}).get("workdir")
        if workdir and not Path(workdir).is_dir():
            workdir = None
    except (ConfigError, ValueError) as e:
        print(f"draftsmith validate: {e}", file=sys.stderr)
        return 2
    findings = validate_results(config, results, configfiles, workdir)
    for f in findings:
        print(f"{'ok  ' if f.ok else 'FAIL'} {f.path}: {f.message}")
    if args.json:
        write_findings(findings, args.json)
    bad = sum(not f.ok for f in findings)
    print(f"{len(findings) - bad} passed, {bad} failed")
    return 1 if bad else 0


def cmd_preflight(args) -> int:
    from draftsmith.config.workflow import ConfigError, load_config
    from draftsmith.preflight import count_samples, count_tokens, preflight_target, run_preflight

    try:
        config = load_config(args.config)
    except ConfigError as e:  # one line per problem, as `draftsmith validate` prints them
        print(f"draftsmith preflight: {e}", file=sys.stderr)
        return 2
    stats = [Path(config["results"]) / "prepared" / d / "stats.json" for d in config["datasets"]]
    report = run_preflight(config, preflight_target(config, args.target), args.disable_fix, count_tokens(stats),
                           samples=count_samples(stats), offline=True)
    print("\n".join(report.lines()))
    print(f"preflight: {'ok' if report.ok else f'{len(report.problems)} problem(s)'}")
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0 if report.ok else 1


def fix_names(text: str) -> list[str]:
    """--disable-fix's value: fix names, comma-separated."""
    from draftsmith.vllm_stack.compat import FIX_NAMES

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FIX_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fix {', '.join(unknown)}; one of: {', '.join(FIX_NAMES)}")
    return names


def add_preflight_parser(sub) -> None:
    from draftsmith.vllm_stack.compat import FIX_NAMES

    p = sub.add_parser("preflight", help="check the installed stack, target, layers, GPUs and disk in seconds, before "
                       "any weights load", description="Check the installed stack, the target's config.json, layer ids, "
                       "seq_length, shard count, every GPU count and the disk against the config, in seconds and before "
                       "any weights load. A target the workflow builds itself is checked once it is built; the hub is "
                       "read from its cache only.")
    p.add_argument("--config", nargs="+", default=[], metavar="FILE",
                   help="workflow config file(s), merged in order over the embedded default config/config.yaml")
    p.add_argument("--target", help="target model path or hub id (default: from the config)")
    p.add_argument("--json", help="also write the report as JSON here")
    p.add_argument("--disable-fix", action="extend", type=fix_names, default=[], metavar="FIX[,FIX]",
                   help="check as if these vLLM compatibility fixes were off, to see what each prevents; one of: "
                   + ", ".join(FIX_NAMES))
    p.set_defaults(func=cmd_preflight)


def cmd_inspect(args) -> int:
    path = Path(args.path)
    if (path / "manifest.json").exists():
        from draftsmith.extraction.shards import load_manifest

        m = load_manifest(path)
        info = {k: m[k] for k in ("format", "backend", "shard", "num_shards", "num_samples", "num_tokens", "aux_layer_ids",
                                  "hidden_size", "dtype", "device", "tokens_per_second")}
        info["model"] = m["model"].get("path")
        info["versions"] = m["versions"]
    elif (path / "config.json").exists() and (path / "model.safetensors").exists():
        from safetensors import safe_open

        config = read_json(path / "config.json", rebuild=forcerun_hint(path / "config.json"))
        with safe_open(path / "model.safetensors", framework="pt") as f:
            params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
        layer = config.get("transformer_layer_config", {})
        info = {"type": config.get("speculators_model_type"), "verifier": config["speculators_config"]["verifier"]["name_or_path"],
                "draft_layers": layer.get("num_hidden_layers"), "hidden_size": layer.get("hidden_size"),
                "draft_vocab_size": config.get("draft_vocab_size"),
                "aux_layer_ids": config.get("eagle_aux_hidden_state_layer_ids"),
                "speculative_tokens": config["speculators_config"]["proposal_methods"][0].get("speculative_tokens"),
                "saved_parameters": params}
    else:
        print(f"{path}: neither a shard directory (manifest.json) nor a draft checkpoint (config.json + model.safetensors)",
              file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2))
    return 0


def cmd_summary(args) -> int:
    from draftsmith.report.summary import NoReportError, summary_lines

    try:
        print("\n".join(summary_lines(Path(args.results))))
    except NoReportError as e:
        print(f"draftsmith summary: {e}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftsmith",
        description="Train and measure EAGLE-3 draft models. The pipeline itself runs with `snakemake --cores all`; "
        "these commands check and inspect its inputs and outputs.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_preflight_parser(sub)
    p = sub.add_parser("validate", help="check a whole results tree against the config: every output it implies exists and "
                       "is intact (samples, shard checksums and tensors, vocab map, drafts, benchmarks, report), and each "
                       "draft and benchmark was made from the current target, shards, vocab map and prompts")
    p.add_argument("results", nargs="?", help="results directory (default: the config's `results`)")
    p.add_argument("--config", nargs="+", default=[], metavar="FILE",
                   help="workflow config file(s) to hold the results to, merged in order over the embedded default "
                   "config/config.yaml: they say which outputs must exist and with which settings (default: the files "
                   "the tree's last run was given, recorded in RESULTS/.draftsmith/run.json)")
    p.add_argument("--json", help="also write the findings to this JSON file")
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("inspect", help="summarise a shard directory or a draft checkpoint")
    p.add_argument("path", help="a shard directory (with manifest.json) or a draft directory (config.json + model.safetensors)")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("summary", help="print a finished run's verdict (from its report) and the next command to try "
                       "on your own model and data")
    p.add_argument("results", nargs="?", default="results", help="results directory (default: results)")
    p.set_defaults(func=cmd_summary)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
