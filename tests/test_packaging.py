"""The dependency bounds are tested ones: every lower bound in pyproject.toml (project dependencies and the
extras) is pinned at exactly that version in .ci/lowest.txt, which CI installs in a fresh virtual
environment to run the whole suite; torch alone is exempt (see .ci/lowest.txt). The README's test command
is the one .ci/run runs."""

import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _requirements() -> list[Requirement]:
    text = (ROOT / "pyproject.toml").read_text()
    block = text[text.index("dependencies = [") : text.index("[project.scripts]")]
    return [Requirement(s) for s in re.findall(r'"([A-Za-z0-9_.\-]+\s*[<>=!~][^"]*)"', block)]


def _lower_bound(req: Requirement) -> Version | None:
    lows = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
    return max(lows) if lows else None


def test_every_lower_bound_is_pinned_in_the_lowest_constraints():
    pins = {}
    for line in (ROOT / ".ci" / "lowest.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower()] = Version(version)
    reqs = _requirements()
    assert {r.name.lower() for r in reqs} >= {
        "torch",
        "numba",
        "numpy",
        "transformers",
    }  # parsed them all
    for req in reqs:
        name, low = req.name.lower(), _lower_bound(req)
        if name == "torch":
            assert name not in pins
            continue
        assert low is not None, f"{req} has no lower bound; give it the lowest version CI tests"
        assert pins.get(name) == low, (
            f"pyproject.toml says {req}, .ci/lowest.txt pins {name}=={pins.get(name)}: "
            "make them the same version"
        )


def test_ci_runs_the_readme_test_command():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    command = next(
        line
        for line in readme.splitlines()
        if "python -m pytest" in line and line.startswith("pip ")
    )
    assert command in ci.splitlines(), (
        "README.md's test command and .ci/run differ: keep them in sync"
    )
