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
