"""The offline benchmark backend: every method on every prompt with draftsmith's PyTorch loops.

Methods: `target_greedy` (the baseline and the reference output), `prompt_lookup` (n-gram
drafts, no training), `untrained_draft` (a freshly initialised EAGLE-3 draft of the trained
draft's shape and vocabulary: what the architecture gives before training) and
`eagle3_draft` (the trained checkpoint). Each speculative method's output must equal the
target's greedy output; the summary records that per method as `lossless`. A prompt with a
`follow_up` (MT-Bench's second turn) is followed by that turn, asked after the target's own greedy
answer to the first; its rows carry the prompt id with `_turn2` appended.

Every method decodes through the engine (draftsmith.decoding.engine.serve; its proposers and decoders:
draftsmith.benchmark.methods), at batch 1 as under load; a target whose masks draftsmith cannot build (sliding windows,
non-SDPA attention) decodes through the eager reference loops instead (draftsmith.decoding.reference), batch 1 only.

Timing: after an untimed warm-up (on a CUDA device the capture of every step shape, then every method once on the
first prompt), each prompt is decoded `benchmark.repeats` times by every method, the methods interleaved: run r
of a prompt runs each method once, in an order rotated by one from run to run and from prompt to prompt, so that no
method always goes first and a burst of load on the machine hits the methods alike. A prompt's time per method is
the median of its runs; `run_order` records each run's position of the method, `repeat_seconds` the times. Greedy
decoding is deterministic: every run must emit the same tokens with the same counts; a run that does not is
reported (`unrepeatable_prompts` in the summary), not hidden (draftsmith.benchmark.interleaved).

Concurrency (`benchmark.batch_sizes`, draftsmith.config.batch_sizes): size 1 is the loop above, one prompt at a
time. A larger size N decodes the same prompts (a second
turn after the target's batch-1 answer, so size 1 must be measured where prompts have one) with N requests in flight,
as a server under a closed-loop load has them: each row takes the next prompt as soon as its answer ends
(CUDA graphs per row count, captured before timing). After an untimed warm-up run of every method on all the prompts, every method runs them `repeats` times,
interleaved; each prompt's row gets the run's wall time over the prompts (summed: the run's throughput) and its own
time to first token and time per output token. Rows carry their `batch_size` (the concurrency); per size, each
speculative method's outputs are compared with target-only greedy's at that size, and target-only greedy's with its
batch-1 outputs (`matches_batch_1`); the summary's `per_batch_size` and `pays_up_to` are the vllm backend's (the same
helper), with the requests' latency percentiles (ttft_p50, tpot_p50, tpot_p90).
"""

from __future__ import annotations

import logging
import statistics

import torch
from tqdm import tqdm

from draftsmith.benchmark.divergence import divergence_gap
from draftsmith.benchmark.interleaved import per_prompt, time_batch_interleaved, time_interleaved
from draftsmith.benchmark.methods import ProposerSettings, method_decoders, method_proposers, one_at_a_time
from draftsmith.benchmark.results import BASELINE, METHODS, write_results
from draftsmith.benchmark.step_costs import measure_step_costs
from draftsmith.config.batch_sizes import batch_sizes
from draftsmith.decoding.batch_target import BatchTarget
from draftsmith.decoding.engine import serve_length
from draftsmith.decoding.draft_kernels import fuse_rms_norms
from draftsmith.decoding.engine_proposers import BatchEagle3Proposer
from draftsmith.decoding.ragged_attention import use_ragged
from draftsmith.decoding.static_cache import full_attention_sdpa
from draftsmith.decoding.target import TargetModel
from draftsmith.devices import resolve_device, resolve_dtype
from draftsmith.draft_model import build_draft, load_draft
from draftsmith.provenance import device_description, package_versions
from draftsmith.target_model.layers import resolve_aux_layer_ids, text_config
from draftsmith.target_model.spec import TargetSpec, stop_token_ids

log = logging.getLogger(__name__)


def check_settings(cfg: dict) -> None:
    if BASELINE not in cfg["methods"]:
        raise ValueError(f"benchmark methods {cfg['methods']} lack {BASELINE}: it is the reference output and the "
                         "speedup baseline")
    if cfg["temperature"] != 0:
        raise ValueError(f"benchmark.temperature = {cfg['temperature']}: only greedy decoding (0) is measured")
    unknown = [m for m in cfg["methods"] if m not in METHODS]
    if unknown:
        raise ValueError(f"benchmark methods {unknown} are unknown; known: {METHODS}")
    sizes = batch_sizes(cfg, "offline")
    if min(sizes) < 1 or sizes != sorted(set(sizes)):
        raise ValueError(f"benchmark.batch_sizes (or batch_size) = {sizes}: sizes must be >= 1, ascending, no repeats")
    for key in ("num_speculative_tokens", "max_new_tokens", "repeats", "load_requests_per_row"):
        if int(cfg.get(key, 1)) < 1:
            raise ValueError(f"benchmark.{key} must be >= 1, got {cfg[key]}")
    refill = cfg.get("refill_rounds", "auto")
    if refill != "auto" and not (isinstance(refill, (int, float)) and refill >= 0):
        raise ValueError(f"benchmark.refill_rounds must be auto or a number >= 0, got {refill!r}")


def refill_rounds(setting, cuda_graphs: bool) -> float:
    """benchmark.refill_rounds: auto is 1 with CUDA graphs (a replayed prefill of a small target is launch-bound: it
    costs about a step whatever its rows, so refills in batches cost less) and 0 without (an eager prefill costs by
    its tokens, and waiting only leaves rows idle)."""
    return (1.0 if cuda_graphs else 0.0) if setting == "auto" else float(setting)


def use_cuda_graphs(setting, model, device: torch.device) -> bool:
    """benchmark.cuda_graphs: auto is on for a CUDA device and a full-attention SDPA target."""
    possible = device.type == "cuda" and full_attention_sdpa(model)
    if setting is True and not possible:
        raise ValueError(f"benchmark.cuda_graphs: true needs a CUDA device and a full-attention SDPA target; "
                         f"here the device is {device} and the target's attention is "
                         f"{getattr(model.config, '_attn_implementation', None)} (sliding windows count against it)")
    return possible if setting == "auto" else bool(setting)


def draft_aux_layer_ids(draft, num_layers: int) -> list[int]:
    configured = draft.config.eagle_aux_hidden_state_layer_ids
    if not configured:
        log.warning("the draft config has no eagle_aux_hidden_state_layer_ids; using vLLM's default layers")
    return resolve_aux_layer_ids(configured, num_layers)


def untrained_like(trained, target: TargetSpec, aux_layer_ids: list[int], k: int, seed: int):
    """A freshly initialised draft with the trained draft's layers, auxiliary layers and vocabulary map."""
    return build_draft(
        target,
        trained.d2t.detach().cpu(),
        trained.t2d.detach().cpu(),
        draft_layers=trained.config.transformer_layer_config.num_hidden_layers,
        aux_layer_ids=aux_layer_ids,
        num_speculative_tokens=k,
        seed=seed,
    )


def run_offline_benchmark(target: TargetSpec, draft_dir: str, prompts: list[dict], cfg: dict, out_per_prompt, out_summary,
                          variant: str) -> dict:
    check_settings(cfg)
    sizes = batch_sizes(cfg, "offline")
    if 1 not in sizes and any("follow_up" in p for p in prompts):
        raise ValueError(f"benchmark.batch_sizes = {sizes}: prompts with a follow_up turn need size 1 (the second turn "
                         "follows the target's batch-1 answer)")
    k, max_new_tokens = int(cfg["num_speculative_tokens"]), int(cfg["max_new_tokens"])
    repeats = int(cfg["repeats"])
    device = resolve_device(cfg["device"])
    dtype = resolve_dtype(target.stage_dtype(cfg["dtype"]), device)
    seed = int(cfg["seed"])
    torch.manual_seed(seed)

    tokenizer = target.load_tokenizer()
    log.info("loading target %s (%s, %s)", target.model, device, dtype)
    model = target.load_causal_lm(dtype).to(device).eval()
    # the target's RMSNorms as one fused kernel each (draftsmith.decoding.draft_kernels), in the baseline and every
    # method alike: a small model's step is its kernel count, and on one H100 they were a third of SmolLM2's (about
    # eight kernels a norm, 61 norms); a verification's norms also leave PyTorch's vectorized path (docs/BENCHMARKS.md)
    fused_norms = fuse_rms_norms(model)
    log.info("loading draft %s", draft_dir)
    trained = load_draft(draft_dir, device, dtype)
    aux_layer_ids = draft_aux_layer_ids(trained, text_config(model.config).num_hidden_layers)
    methods = [m for m in METHODS if m in cfg["methods"]]
    if "untrained_draft" in methods:
        untrained = untrained_like(trained, target, aux_layer_ids, k, seed).to(device=device, dtype=dtype).eval()
    graphs = use_cuda_graphs(cfg["cuda_graphs"], model, device)
    log.info("decoding steps %s", "replayed as CUDA graphs over a static KV cache" if graphs else "run eagerly")
    runner = TargetModel(model, aux_layer_ids)
    if max(sizes) > 1 and not runner.static:
        raise ValueError(f"benchmark.batch_sizes = {sizes}: batch sizes above 1 need a full-attention SDPA target "
                         f"(here {getattr(model.config, '_attn_implementation', None)}, or sliding windows)")
    stop_ids = stop_token_ids(tokenizer, model)
    ngram = int(cfg["prompt_lookup_ngram"])

    ragged = runner.static and use_ragged(str(cfg.get("attention", "ragged")), device, "benchmark")
    settings = ProposerSettings(device, ngram, {"eagle3_draft": trained, **(
        {"untrained_draft": untrained} if "untrained_draft" in methods else {})}, cfg.get("hybrid_min_ngram"),
        batched=runner.static, cuda_graphs=graphs, ragged=ragged)
    proposers = method_proposers(methods, settings)

    def render(messages):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)

    first_ids = render(prompts[0]["messages"])
    if runner.static:  # the engine, one request at a time
        engine = BatchTarget(runner, cuda_graphs=graphs, ragged=ragged)
        decoders = one_at_a_time(method_decoders(methods, engine, proposers, k, max_new_tokens, stop_ids, concurrency=1))
        # buffers sized for the longest prompt (a second turn adds an answer), every step shape captured
        longest = max(len(render([*p["messages"], {"role": "user", "content": p.get("follow_up", "")}])) for p in prompts)
        longest += max_new_tokens + 64 if any("follow_up" in p for p in prompts) else 0
        prepare_engine(engine, proposers, 1, serve_length([[0] * longest], max_new_tokens, k), k, longest)
    else:
        engine = runner
        decoders = method_decoders(methods, runner, proposers, k, max_new_tokens, stop_ids)
    log.info("warm-up: every method once on prompt %s", prompts[0]["prompt_id"])
    for decode in decoders.values():
        decode(first_ids)

    rows, outputs, rendered, categories = [], {m: {} for m in methods}, {}, {}
    unrepeatable: dict[str, list[str]] = {m: [] for m in methods}
    log.info("timing: %d run(s) of every method per prompt, interleaved (order rotated per prompt and run)", repeats)
    queue, index = list(prompts) if 1 in sizes else [], 0
    progress = tqdm(total=len(queue) + sum("follow_up" in p for p in queue), desc=f"benchmark {variant}",
                    unit="prompt", mininterval=5)
    while queue:
        prompt = queue.pop(0)
        pid, ids = prompt["prompt_id"], render(prompt["messages"])
        rendered[pid], categories[pid] = ids, prompt["category"]
        # Methods alternate within each run, in an order rotated per prompt and run, so that drifting clocks,
        # thermals or other jobs on the machine hit all of them alike; the median of the runs is the prompt's time.
        timed = time_interleaved(decoders, ids, repeats, index, k)
        index += 1
        for method, t in timed.items():
            outputs[method][pid] = t.trace.tokens
            rows.append({"variant": variant, "backend": "offline", "method": method, "prompt_id": pid,
                         "category": prompt["category"], "batch_size": 1, "prompt_tokens": len(ids), **t.row(k)})
            if not t.repeatable:
                unrepeatable[method].append(pid)
                log.error("NOT REPEATABLE: %s on prompt %s emitted other tokens or counts in a later run", method, pid)
        log.info("prompt %s (%s): %d prompt tokens, %d new tokens; acceptance length %s; median seconds %s; spread %s",
                 pid, prompt["category"], len(ids), len(outputs[BASELINE][pid]),
                 ", ".join(f"{m} {len(t.trace.tokens) / t.trace.target_forwards:.2f}" for m, t in timed.items()),
                 ", ".join(f"{m} {statistics.median(t.seconds):.3f}" for m, t in timed.items()),
                 ", ".join(f"{m} {(max(t.seconds) - min(t.seconds)) / statistics.median(t.seconds):.0%}"
                           for m, t in timed.items() if len(t.seconds) > 1 and statistics.median(t.seconds) > 0) or "-")
        if "follow_up" in prompt:  # the next turn, after the target's own (greedy) answer to this one
            answer = tokenizer.decode(outputs[BASELINE][pid], skip_special_tokens=True).strip()
            queue.insert(0, {"prompt_id": f"{pid}_turn2", "category": prompt["category"],
                             "messages": [*prompt["messages"], {"role": "assistant", "content": answer},
                                          {"role": "user", "content": prompt["follow_up"]}]})
        progress.update()
    progress.close()
    if 1 not in sizes:
        for prompt in prompts:
            rendered[prompt["prompt_id"]] = render(prompt["messages"])
            categories[prompt["prompt_id"]] = prompt["category"]
    outputs_by_size = {1: outputs} if 1 in sizes else {}
    requests, load_extras = {}, {}  # per size above 1: how many requests the prompts made; refills, step costs
    cfg = {**cfg, "refill_rounds": refill_rounds(cfg.get("refill_rounds", "auto"), graphs)}
    for size in [s for s in sizes if s > 1]:
        outputs_by_size[size], requests[size], load_extras[size] = time_concurrency(
            size, methods, rendered, categories, cfg, engine, settings, stop_ids, rows, unrepeatable, variant)
    num_prompts = len(rendered)

    lossless, mismatched, divergences, size_extras = compare_outputs(outputs_by_size, methods, sizes, runner, rendered,
                                                                     dtype)
    for size, count in requests.items():
        for method in methods:
            size_extras[size][method]["requests"] = count
            size_extras[size][method].update(load_extras[size][method])
    meta = {
        "variant": variant,
        "backend": "offline",
        "device": device_description(device),
        "dtype": str(dtype).removeprefix("torch."),
        "max_new_tokens": max_new_tokens,
        "num_prompts": num_prompts,
        "batch_sizes": sizes,
        "prompt_lookup_ngram": ngram,
        "aux_layer_ids": aux_layer_ids,
        "cuda_graphs": graphs,
        "refill_rounds": cfg["refill_rounds"],
        "target_norms_fused": fused_norms,
        "attention": "ragged" if ragged else ("sdpa" if runner.static else "transformers"),
        "repeats": repeats,
        "timing": "interleaved",
        "versions": package_versions(),
    }
    extras = {m: {"repeatable": not unrepeatable[m], "unrepeatable_prompts": list(dict.fromkeys(unrepeatable[m]))}
              for m in methods}
    for m in lossless:
        extras[m].update(lossless=lossless[m], mismatched_prompts=mismatched[m], divergences=divergences[m])
    for method in [m for m in methods if hasattr(proposers.get(m), "rounds")]:  # a hybrid's rounds by source, batch 1
        extras[method]["rounds_drafted_by"] = dict(proposers[method].rounds)
    for method in [m for m in methods if isinstance(proposers.get(m), BatchEagle3Proposer)]:  # batch 1, the engine's
        extras[method]["step_costs"] = measure_step_costs(engine, proposers[method], first_ids, k)
    summary = write_results(rows, k, out_per_prompt, out_summary, meta, extras, size_extras)
    log_summary(summary, k, sizes)
    return summary


def prepare_engine(target: BatchTarget, proposers: dict, rows: int, length: int, k: int,
                   longest_prompt: int | None = None) -> None:
    """The engine's buffers for `rows` rows of `length` slots (sized for the longest prompt), and every step shape
    captured before timing: the target's (and, given the longest prompt, its one-row prefills) and each draft's."""
    drafts = [p for p in proposers.values() if isinstance(p, BatchEagle3Proposer)]
    target.reserve(rows, length)
    target.capture(rows, k, longest_prompt)
    for draft in drafts:
        draft.reserve(rows, length)
        draft.capture(rows, k, longest_prompt)
    if target.buffers.graphs.enabled:
        log.info("%d rows: captured %d target steps and %s draft rounds; caches hold %d slots (a target step reads %s)",
                 rows, len(target.buffers.graphs.steps), "+".join(str(len(p.buffers.graphs.steps)) for p in drafts),
                 target.rows.cache.length, "each row's own slots" if target.ragged else "the whole cache")


def compare_outputs(outputs_by_size: dict[int, dict[str, dict[str, list[int]]]], methods: list[str], sizes: list[int],
                    runner: TargetModel, rendered: dict[str, list[int]], dtype) -> tuple[dict, dict, dict, dict]:
    """Every method's outputs against target-only greedy decoding's at each batch size (and greedy's at each size
    against batch 1): per method lossless, the mismatched prompts and their divergences; per size and method the same
    (`size_extras`)."""
    num_prompts = len(rendered)
    # Exact in float32. In bf16/fp16 a verification step over k+1 tokens rounds differently from a
    # one-token step, so an output can leave the greedy one at a near-tie; that is reported, not hidden.
    # Each difference is located and sized (the target's logit gap between its token and the emitted one there),
    # so that a near-tie is told apart from a decoding error.
    lossless, mismatched, divergences = {}, {}, {}
    size_extras = {size: {m: {} for m in methods} for size in sizes}
    for method in methods[1:]:
        mismatched[method], divergences[method] = [], {}
        for size, by_method in outputs_by_size.items():
            got, reference = by_method[method], by_method[BASELINE]
            bad = [pid for pid, tokens in got.items() if tokens != reference[pid]]
            size_extras[size][method].update(lossless=not bad, mismatched_prompts=bad)
            mismatched[method] += [pid for pid in bad if pid not in mismatched[method]]
            gaps = {pid: divergence_gap(runner, rendered[pid], got[pid], reference[pid]) for pid in bad}
            divergences[method] = {**gaps, **divergences[method]}  # the smallest size's where several differ
            if bad:
                log.error("NOT LOSSLESS: %s's output differs from target-only greedy decoding at batch size %d on %d "
                          "of %d prompts (%s): %s", method, size, len(bad), num_prompts, dtype,
                          ", ".join(f"{pid} at token {d['position']} (logit gap {d['logit_gap']})"
                                    for pid, d in list(gaps.items())[:10]))
        lossless[method] = not mismatched[method]
    for size in [s for s in sizes if s > 1 and 1 in sizes]:
        differ = [pid for pid, tokens in outputs_by_size[size][BASELINE].items()
                  if tokens != outputs_by_size[1][BASELINE][pid]]
        size_extras[size][BASELINE]["matches_batch_1"] = not differ
        if differ:
            log.error("target-only greedy decoding at batch size %d differs from batch size 1 on prompts %s", size, differ)
    return lossless, mismatched, divergences, size_extras


def log_summary(summary: dict, k: int, sizes: list[int]) -> None:
    """Each method's figures from the summary, to the rule's log."""
    for method, stats in summary["methods"].items():
        low, high = stats["speedup_range"] or (float("nan"), float("nan"))
        spread = stats["time_spread"] if stats["time_spread"] is not None else float("nan")
        log.info("%s: acceptance length %.3f, %.1f tokens/s, speedup %.2fx (%.2f-%.2fx over %d runs; timing spread %.0f%%, "
                 "after the first token %.2fx)", method, stats["acceptance_length"], stats["tokens_per_s"],
                 stats["speedup"], low, high, stats["repeats"], 100 * spread, stats["decode_speedup"])
        if len(sizes) > 1:
            log.info("%s: by batch size: %s; pays up to %s", method, ", ".join(
                f"{size}: {e['tokens_per_s']:.1f} tokens/s, speedup {e['speedup']:.2f}x, acceptance length "
                f"{e['acceptance_length']:.2f}" for size, e in stats["per_batch_size"].items()), stats.get("pays_up_to"))
        if "step_costs" in stats:
            costs = stats["step_costs"]
            log.info("%s: draft step %.2f ms, target step %.2f ms (verification over %d tokens %.2f ms): c = %.3f, "
                     "ideal speedup tau / (1 + k c) = %.2fx", method, costs["draft_step_ms"], costs["target_step_ms"],
                     k + 1, costs["verify_step_ms"], costs["cost_ratio"], stats["ideal_speedup"])
            for step, kernels in costs.get("kernels", {}).items():  # on a GPU
                log.info("%s: %s runs %d kernels, %.0f us: %s", method, step, kernels["count"], kernels["us"], ", ".join(
                    f"{kernel['name'][:60]} x{kernel['calls']} {kernel['us']:.0f} us" for kernel in kernels["top"]))


def time_concurrency(size: int, methods: list[str], rendered: dict[str, list[int]], categories: dict[str, str], cfg: dict,
                     target: BatchTarget, settings: ProposerSettings, stop_ids: set[int], rows: list[dict],
                     unrepeatable: dict[str, list[str]], variant: str) -> tuple[dict, int, dict]:
    """Every method on the rendered prompts with `size` requests in flight (draftsmith.decoding.engine.serve:
    a row takes the next prompt as its answer ends), the prompts in as many whole passes as give at least
    `benchmark.load_requests_per_row` requests a row, after an untimed warm-up run of every method; each method
    `repeats` times, interleaved. Appends one row per prompt (its requests' tokens must agree; their latency is the
    median of them) and the unrepeatable prompts; returns each method's outputs by prompt id, the number of requests,
    and per method the refills of a run and their share of its wall time (medians), with each EAGLE-3 method's step
    costs with that many rows at once (`measure_step_costs`)."""
    k, max_new_tokens, repeats = int(cfg["num_speculative_tokens"]), int(cfg["max_new_tokens"]), int(cfg["repeats"])
    proposers = method_proposers(methods, settings)  # their own: a hybrid counts the rounds of this size
    decoders = method_decoders(methods, target, proposers, k, max_new_tokens, stop_ids, concurrency=size,
                               refill_rounds=cfg["refill_rounds"])
    pids = list(rendered)
    # The prompt set in whole passes, enough that the rows stay busy: with 80 prompts at 64 in flight a single pass is
    # mostly its ramp-down (16 refills, then fewer and fewer rows), not N requests in flight.
    passes = -(-int(cfg.get("load_requests_per_row", 1)) * size // len(pids))
    requests = pids * passes
    in_flight = min(size, len(requests))
    prepare_engine(target, proposers, in_flight, serve_length(list(rendered.values()), max_new_tokens, k), k)
    # The warm-up is a whole run of every method: the timed runs then refill with prefills of shapes (rows, width) the
    # warm-up already ran (greedy decoding is deterministic: the rows come free in the same order). A warm-up on the
    # first `size` prompts alone left them cold, and on one H100 in bf16 the first method to meet each new prefill
    # shape paid for it: at 16 in flight, time to first token 62-65 ms for the methods that met them first, 21-22 ms
    # for those after (docs/BENCHMARKS.md, "Under load").
    log.info("concurrency %d: %d prompts x %d passes = %d requests, %d in flight; warm-up: every method once on all "
             "of them", size, len(pids), passes, len(requests), in_flight)
    batch = [rendered[pid] for pid in requests]
    for decode in decoders.values():
        decode(batch)
    outputs: dict[str, dict[str, list[int]]] = {m: {} for m in methods}
    refills: dict[str, list[tuple[int, float]]] = {m: [] for m in methods}
    timed = time_batch_interleaved({m: counting_refills(target, d, refills[m]) for m, d in decoders.items()}, batch,
                                   repeats, 0, k)
    for method, request_rows in timed.items():
        for pid, t in per_prompt(request_rows, requests, k).items():
            outputs[method][pid] = t.trace.tokens
            rows.append({"variant": variant, "backend": "offline", "method": method, "prompt_id": pid,
                         "category": categories[pid], "batch_size": size, "prompt_tokens": len(rendered[pid]), **t.row(k)})
            if not t.repeatable:
                unrepeatable[method].append(pid)
                log.error("NOT REPEATABLE: %s on prompt %s at concurrency %d emitted other tokens or counts in a later "
                          "run or request", method, pid, size)
    log.info("concurrency %d: median seconds of the whole run %s", size,
             ", ".join(f"{m} {sum(statistics.median(t.seconds) for t in ts):.3f}" for m, ts in timed.items()))
    costs = {m: measure_step_costs(target, p, batch[0], k, in_flight) for m, p in proposers.items()
             if isinstance(p, BatchEagle3Proposer)}
    for method, c in costs.items():
        log.info("concurrency %d, %s: %d rows at once: target step %.2f ms, verification over %d tokens a row %.2f ms, "
                 "draft step %.2f ms", size, method, in_flight, c["target_step_ms"], k + 1, c["verify_step_ms"],
                 c["draft_step_ms"])
    extras = {m: {"refills": statistics.median(n for n, _ in runs), "refill_share": statistics.median(s for _, s in runs),
                  **({"step_costs": costs[m]} if m in costs else {})} for m, runs in refills.items()}
    log.info("concurrency %d: refills a run (median) and their share of its wall time: %s", size,
             ", ".join(f"{m} {e['refills']:g}, {100 * e['refill_share']:.1f}%" for m, e in extras.items()))
    return outputs, len(requests), extras


def counting_refills(target: BatchTarget, decode, runs: list):
    """`decode`, appending to `runs` each run's refills and their share of its wall time (`target.stats`)."""
    def run(batch):
        refills, seconds = target.stats["refills"], target.stats["refill_seconds"]
        traces = decode(batch)
        wall = sum(t.seconds for t in traces)
        runs.append((target.stats["refills"] - refills, (target.stats["refill_seconds"] - seconds) / wall))
        return traces

    return run
