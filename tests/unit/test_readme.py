"""README.md stays true: its configuration reference is the generated one, and its Quickstart
is exactly two commands, the second being what .ci/run runs."""

import re
from pathlib import Path

from zerotrain.config.reference import reference

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_configuration_reference_is_current():
    assert reference() in README, "regenerate the README table with python -m zerotrain.config.reference"


def test_quickstart_is_two_commands_and_ci_runs_them():
    block = re.search(r"## Quickstart.*?```bash\n(.*?)```", README, re.DOTALL).group(1)
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci
    assert "pip install torch==2.13.0" in commands[0] and "pip install torch==2.13.0" in ci
    assert "pip install -e '.[dev]'" in ci
