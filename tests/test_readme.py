"""The README stays true: its first lines are the two set-up commands, CI runs the test
command, and the configuration table matches the code."""

from __future__ import annotations

from pathlib import Path

from relay_trio.config import config_table

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_starts_with_exactly_two_setup_commands():
    lines = README.splitlines()
    assert lines[0] == "# relay-trio"
    start = lines.index("```sh")
    end = lines.index("```", start + 1)
    commands = [ln.split("#")[0].strip() for ln in lines[start + 1 : end] if ln.strip()]
    assert commands == ["./scripts/serve", "./scripts/test"]
    assert start < 5, "the set-up commands must be the README's first lines"
    for cmd in commands:
        script = ROOT / cmd
        assert script.exists() and script.stat().st_mode & 0o111, f"{cmd} must exist and be executable"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/test" in ci
    assert "exit code 5" in (ROOT / "scripts" / "test").read_text() or '"$rc" -eq 5' in (ROOT / "scripts" / "test").read_text()


def test_configuration_table_matches_the_code():
    assert config_table() in README, "README configuration table is stale: paste the output of `relay-trio config`"
