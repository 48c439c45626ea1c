"""Preflight's verdict: one Check per line (`ok`, `warn` or `FAIL`), the problems (the failing checks), and the
compatibility fixes' report, as lines for the log and as JSON for preflight.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Check:
    name: str
    status: str  # "ok", "warn" or "fail"
    message: str

    def line(self) -> str:
        return f"[{'FAIL' if self.status == 'fail' else self.status:>4}] {self.name}: {self.message}"


@dataclass
class Verdict:
    checks: list[Check] = field(default_factory=list)
    fixes: list[dict] = field(default_factory=list)

    def add(self, name: str, status: str, message: str) -> None:
        self.checks.append(Check(name, status, message))

    @property
    def problems(self) -> list[str]:
        return [f"{c.name}: {c.message}" for c in self.checks if c.status == "fail"]

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        return [c.line() for c in self.checks]

    def to_dict(self) -> dict:
        return {"ok": self.ok, "problems": self.problems, "checks": [asdict(c) for c in self.checks], "fixes": self.fixes}
