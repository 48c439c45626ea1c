"""The chain acceptance length a draft's validation accuracies predict: one formula, for training's metrics and the report.

speculators 0.3.0 (`speculators.models.eagle3.core.compute_accuracy`) logs two accuracies per TTT step i:
`full_acc_i`, the fraction of (loss-masked) positions whose draft tokens of steps 0..i were all the target's greedy
tokens (cumulative: `correct` is and-ed with the previous steps' before it is counted), and `cond_acc_i`, the same
count over the positions whose steps 0..i-1 were right (conditional). A chain of k drafted tokens yields the bonus
token plus every draft token up to the first rejected one, so a drafted round is expected to yield
1 + full_acc_0 + ... + full_acc_(k-1) tokens; in conditional accuracies c that is 1 + c_0 + c_0 c_1 + ...
(each full_acc_i is c_0 c_1 ... c_i). The benchmark measures the same quantity as `tokens_per_drafted_round`
(draftsmith.benchmark.results); its `acceptance_length` (tokens per target forward, each prompt's forward counted)
is a little lower.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

FULL_ACC = "full_acc_"
# the metrics.csv column (and training_data.json key) of the prediction
PREDICTED = "predicted_acceptance_length"


def _known(x) -> bool:
    if x is None or x == "":
        return False
    try:
        return not math.isnan(float(x))
    except (TypeError, ValueError):
        return False


def predicted_acceptance_length(full_acc: Sequence, k: int | None = None) -> float | None:
    """Tokens per drafted round a chain of k draft tokens is expected to yield: 1 + a_0 + ... + a_(k-1), with a_i
    speculators' cumulative `full_acc_i` (TTT steps beyond training count as 0; unknown values are left out).
    k None: every step given. None where no accuracy is known."""
    accs = [float(a) for a in (full_acc if k is None else full_acc[:k]) if _known(a)]
    return 1 + sum(accs) if accs else None


def full_accuracies(row: Mapping) -> list:
    """`full_acc_0`, `full_acc_1`, ... of one metrics row (a dict or a pandas row), in TTT-step order."""
    steps = sorted(int(m.group(1)) for c in row.keys() if (m := re.fullmatch(re.escape(FULL_ACC) + r"(\d+)", str(c))))
    return [row[f"{FULL_ACC}{i}"] for i in steps]
