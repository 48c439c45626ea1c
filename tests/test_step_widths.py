"""perf/step_widths.py on the CPU with the tiny target: every width of a round timed per kernel setting, the settings
this device cannot run (cuBLASLt on a CPU build) named as unavailable, the table written."""

import torch
from conftest import load_perf_script

from draftsmith.decoding.static_cache import KERNEL_SETTINGS
from draftsmith.target_model.spec import TargetSpec


def test_step_widths_times_each_width_per_backend(tiny_target, tmp_path):
    module = load_perf_script("step_widths")
    model = TargetSpec(str(tiny_target)).load_causal_lm(torch.float32).eval()
    rows = {r["kernel setting"]: r for r in module.widths_table(model, k=2, prompt_tokens=12, repeats=3)}
    assert list(rows) == [name for name, _, _ in KERNEL_SETTINGS]
    row = rows["cublas + default SDPA"]  # PyTorch's own choices run anywhere
    assert [row[f"width {w} ms"] > 0 for w in (1, 2, 3)] == [True] * 3, row
    assert row["width 3 / width 1"] == round(row["width 3 ms"] / row["width 1 ms"], 3)
    lt = rows["cublaslt + default SDPA"]
    assert "cuBLASLt" in lt["unavailable"] and "width 1 ms" not in lt  # a CPU build has no cuBLASLt
    table = tmp_path / "widths.md"
    module.main(["--target", str(tiny_target), "--k", "2", "--prompt-tokens", "12", "--repeats", "2", "--device", "cpu",
                 "--dtype", "float32", "--table", str(table)])
    lines = [line for line in table.read_text().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header[:5] == ["kernel setting", "width 1 ms", "width 2 ms", "width 3 ms", "width 3 / width 1"]
    assert [line.split("|")[1].strip() for line in lines[2:]] == [name for name, _, _ in KERNEL_SETTINGS]


def test_step_profile_compares_the_two_widths_operator_by_operator(tiny_target, tmp_path):
    """--profile on the CPU: the aten operators of a width-1 step and a width-3 verification, per step, the largest
    differences first and a total that sums them; the linear layers' matrix products are among them."""
    module = load_perf_script("step_widths")
    model = TargetSpec(str(tiny_target)).load_causal_lm(torch.float32).eval()
    table = module.profile_widths(model, k=2, prompt_tokens=12, steps=3)
    assert list(table.columns) == ["operator", "calls per step, width 1", "µs per step, width 1",
                                   "calls per step, width 3", "µs per step, width 3", "difference µs"]
    body, total = table.iloc[:-1], table.iloc[-1]
    assert total["operator"] == "total" and total["µs per step, width 1"] > 0 and total["µs per step, width 3"] > 0
    assert abs(total["µs per step, width 3"] - body["µs per step, width 3"].sum()) < 1
    differences = body["difference µs"].abs().tolist()
    assert differences == sorted(differences, reverse=True)
    products = body[body["operator"].isin(["aten::mm", "aten::addmm", "aten::linear", "aten::matmul"])]
    assert not products.empty and (products["calls per step, width 1"] > 0).all(), body["operator"].tolist()
    out = tmp_path / "profile.md"
    module.main(["--target", str(tiny_target), "--k", "2", "--prompt-tokens", "12", "--repeats", "2", "--device", "cpu",
                 "--dtype", "float32", "--table", str(tmp_path / "widths.md"), "--profile", str(out),
                 "--profile-steps", "2", "--profile-rows", "5"])
    lines = [line for line in out.read_text().splitlines() if line.startswith("|")]
    assert len(lines) == 2 + 5 + 1 and lines[-1].split("|")[1].strip() == "total"


def test_draft_rounds_time_the_draft_as_built_and_with_fewer_kernels(tiny_target, tmp_path):
    """--draft-rounds on the CPU: a fresh draft of the tiny target, its round timed with the modules as built and
    with fewer kernels (the proposers' default), and their ratio; the table written."""
    module = load_perf_script("step_widths")
    model = TargetSpec(str(tiny_target)).load_causal_lm(torch.float32).eval()
    rows = module.draft_round_table(str(tiny_target), model, k=2, prompt_tokens=12, repeats=3, draft_vocab=64)
    assert [r["draft"] for r in rows] == ["as built", "fewer kernels", "fewer kernels / as built"]
    assert rows[0]["round ms"] > 0 and rows[1]["round ms"] > 0
    assert rows[2]["round ms"] == round(rows[1]["round ms"] / rows[0]["round ms"], 3)
    table = tmp_path / "rounds.md"
    module.main(["--target", str(tiny_target), "--k", "2", "--prompt-tokens", "12", "--repeats", "2", "--device", "cpu",
                 "--dtype", "float32", "--table", str(tmp_path / "widths.md"), "--draft-rounds", str(table),
                 "--draft-vocab", "64"])
    lines = [line for line in table.read_text().splitlines() if line.startswith("|")]
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["as built", "fewer kernels", "fewer kernels / as built"]


def test_spans_time_each_width_reading_the_whole_cache_and_the_span_needed(tiny_target, tmp_path):
    """--spans on the CPU: each width timed with a cache of the benchmark's size, the attention reading every slot
    and the span a 12-token sequence needs (the first SPAN_GRANULE slots); the table written."""
    from draftsmith.decoding.static_cache import SPAN_GRANULE

    module = load_perf_script("step_widths")
    model = TargetSpec(str(tiny_target)).load_causal_lm(torch.float32).eval()
    rows = module.span_table(model, k=2, prompt_tokens=12, repeats=3, cache_slots=4 * SPAN_GRANULE)  # (a multiple of the 256-slot granule)
    assert [r["attention reads"] for r in rows] == [f"the whole cache ({4 * SPAN_GRANULE} slots)",
                                                    f"the span needed ({SPAN_GRANULE} slots)"]
    assert all(r[f"width {w} ms"] > 0 for r in rows for w in (1, 2, 3))
    assert rows[1]["same greedy tokens"] is True and rows[1]["max logit difference"] < 1e-4, rows[1]  # float32
    table = tmp_path / "spans.md"
    module.main(["--target", str(tiny_target), "--k", "2", "--prompt-tokens", "12", "--repeats", "2", "--device", "cpu",
                 "--dtype", "float32", "--table", str(tmp_path / "widths.md"), "--spans", str(table),
                 "--cache-slots", str(2 * SPAN_GRANULE)])
    lines = [line for line in table.read_text().splitlines() if line.startswith("|")]
    assert [line.split("|")[1].strip() for line in lines[2:]] == [f"the whole cache ({2 * SPAN_GRANULE} slots)",
                                                                 f"the span needed ({SPAN_GRANULE} slots)"]
