"""README.md and docs/ stay true: the configuration reference in docs/configuration.md is the
generated one; the README's Quickstart is exactly two commands, the second being what .ci/run runs;
every command in a bash block of README.md or docs/*.md parses with zerotrain's own argument
parsers and names repository files that exist, as do the files and modules their inline code
names; every yaml block is a valid run config; every internal link resolves, to a heading where it
names one, and no link leaves the repository; every family has its row in the README's families table; and the
README stays a first page."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from zerotrain.cli import build_parser
from zerotrain.config.reference import embedded, reference
from zerotrain.config.sections import RunConfig

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Words of a command that name a file of this repository (run.yaml, ds.json and launch/ are the user's).
REPO_PATH = re.compile(r"^(examples|deepspeed_configs|zerotrain|benchmarks|tests|docker|docs|\.ci)/")
FENCED = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_configuration_reference_is_current():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert embedded(page) == reference(), (
        "regenerate docs/configuration.md with python -m zerotrain.config.reference --write")
    assert "| `model.name_or_path` |" not in README, "the reference lives in docs/configuration.md, not here"


def test_quickstart_is_two_commands_and_ci_runs_them():
    block = re.search(r"## Quickstart.*?```bash\n(.*?)```", README, re.DOTALL).group(1)
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[0] in ci and commands[1] in ci
    assert "pip install torch==2.13.0" in commands[0] and "pip install -e '.[dev]'" in commands[0]
    # The first command ends with the plan as soon as the install is done; DeepSpeed's ops build in the second,
    # before the tests.
    assert commands[0].split(" && ")[-1].startswith(".venv/bin/zerotrain plan ") and "build-ops" not in commands[0]
    assert commands[1].split(" && ")[0].startswith(".venv/bin/zerotrain build-ops")


# ---- commands -----------------------------------------------------------------------------------

def bash_commands(text: str) -> list[list[str]]:
    """Each simple command of the text's ```bash blocks, as words: continuation lines joined,
    comments dropped, `&&`, `||`, `;` and `|` splitting commands, leading VAR=value dropped."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words: list[str] = []
            for word in [*lexer, ";"]:
                if word in ("&&", "||", ";", "|", "&"):
                    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
                        words.pop(0)
                    if words:
                        commands.append(words)
                    words = []
                else:
                    words.append(word)
    return commands


def _parse(parse, argv: list[str]) -> str | None:
    """None when `parse(argv)` accepts argv, else argparse's message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse(argv)
    except SystemExit as exc:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {exc.code}"
    return None


def _train_args(argv: list[str]) -> argparse.Namespace:
    from zerotrain.train import parse_args  # imports torch: only where a page runs train.py

    return parse_args(argv)


def check_command(words: list[str]) -> list[str]:
    """What is wrong with one command of the docs (nothing: [])."""
    problems = [f"{word} does not exist" for word in words
                if REPO_PATH.match(word) and not (ROOT / word).exists()]
    program, args = Path(words[0]).name, words[1:]
    if program == "srun":
        return problems + check_command(args)
    if program == "zerotrain" or args[:2] == ["-m", "zerotrain.cli"]:
        if program != "zerotrain":
            args = args[2:]
        if args[:1] == ["train"]:
            problem = _parse(_train_args, args[1:])
        else:
            problem = _parse(build_parser().parse_args, args)
        return problems + ([problem] if problem else [])
    if program in ("deepspeed", "torchrun") or program.startswith("python"):
        if "-m" in args:
            module = args[args.index("-m") + 1]
            if importlib.util.find_spec(module) is None:
                problems.append(f"no module {module}")
        scripts = [i for i, word in enumerate(args) if word.endswith(".py")]
        if program in ("deepspeed", "torchrun") and not scripts and "-m" not in args:
            problems.append("names no script to run")
        if scripts and args[scripts[0]] == "zerotrain/train.py":
            problem = _parse(_train_args, args[scripts[0] + 1:])
            problems += [problem] if problem else []
        elif scripts and not (ROOT / args[scripts[0]]).is_file():
            problems.append(f"{args[scripts[0]]} does not exist")
    return problems


def _commands():
    for page in PAGES:
        for words in bash_commands(page.read_text()):
            yield pytest.param(words, id=f"{_name(page)}: {shlex.join(words)[:80]}")


@pytest.mark.parametrize("words", list(_commands()))
def test_every_command_in_the_docs_parses_and_names_files_that_exist(words):
    assert check_command(words) == [], shlex.join(words)


def test_the_command_check_catches_what_it_guards():
    assert check_command(["zerotrain", "plan", "--model", "flux-dev", "--gpus", "1xH100-80GB"]) == []
    assert check_command(["zerotrain", "plan", "--modle", "flux-dev"])  # a misspelled flag
    assert check_command(["zerotrain", "plan", "--config", "examples/nothing-here.yaml"])
    assert check_command(["deepspeed", "zerotrain/train.py", "--confg", "run.yaml"])
    assert check_command(["python", "benchmarks/nothing_here.py"])
    assert check_command(["python", "-m", "zerotrain.nothing_here"])
    assert check_command(["torchrun", "--nproc_per_node", "8"])
    assert bash_commands("```bash\nA=1 zerotrain plan \\\n  --json && ls # x\n```\n") == [
        ["zerotrain", "plan", "--json"], ["ls"]]


def named_in_prose(text: str) -> list[str]:
    """The repository paths (examples/..., zerotrain/..., ...) and `python -m` modules that the
    text's inline code names, but for patterns (`<name>`, `*`, `{a,b}`)."""
    names = []
    for span in re.findall(r"`([^`\n]+)`", FENCED.sub("", text)):
        names += [word.rstrip(",;:)") for word in span.split() if REPO_PATH.match(word) and not re.search(r"[<*{]", word)]
        names += [f"-m {module}" for module in re.findall(r"python -m ([\w.]+)", span)]
    return names


def test_every_file_and_module_the_docs_name_exists():
    missing = [f"{_name(page)}: {name}" for page in PAGES for name in named_in_prose(page.read_text())
               if not (importlib.util.find_spec(name[3:]) if name.startswith("-m ") else (ROOT / name).exists())]
    assert missing == []


def test_the_name_check_catches_what_it_guards():
    assert named_in_prose("`zerotrain/train.py`, `python -m zerotrain.x --y` and `tests/unit/test_<name>.py`") == [
        "zerotrain/train.py", "-m zerotrain.x"]


def _configs():
    for page in PAGES:
        for block in re.findall(r"^```yaml\n(.*?)^```", page.read_text(), re.DOTALL | re.MULTILINE):
            yield pytest.param(block, id=f"{_name(page)}: {block.splitlines()[0][:60]}")


@pytest.mark.parametrize("block", list(_configs()))
def test_every_run_config_in_the_docs_is_valid(block):
    """Each ```yaml block is a run config (or part of one) that validates, but for the dataset
    folders, which are the reader's own."""
    try:
        RunConfig.model_validate(yaml.safe_load(block))
    except ValidationError as err:
        problems = [error for error in err.errors() if error["loc"][:2] != ("data", "datasets")
                    or error["loc"][-1] != "path" or "does not exist" not in error["msg"]]
        assert problems == [], block


# ---- links --------------------------------------------------------------------------------------

def prose(text: str) -> str:
    """The text without its fenced code blocks and inline code spans."""
    return re.sub(r"`[^`]*`", "code", FENCED.sub("", text))


def links(text: str) -> list[str]:
    body = prose(text)
    inline = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", body)
    references = re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", body, re.MULTILINE)
    autolinks = re.findall(r"<(https?://[^>]+)>", body)
    return inline + references + autolinks


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: the heading's text lowercased, punctuation but - and _ dropped,
    spaces as -, and -1, -2, ... after a repeated one."""
    slugs, counts = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", FENCED.sub("", text), re.MULTILINE):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        counts[slug] = counts.get(slug, 0) + 1
        slugs.add(f"{slug}-{counts[slug] - 1}" if counts[slug] > 1 else slug)
    return slugs


def check_link(page: Path, target: str) -> str | None:
    """What is wrong with a link of `page` (nothing: None)."""
    if re.match(r"[a-z]+:", target):
        return f"{target}: the docs link nothing outside the repository"
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
        return f"{target}: no {file}"
    if ROOT not in file.parents and file != ROOT:
        return f"{target}: outside the repository"
    if anchor and (file.suffix != ".md" or anchor not in anchors(file.read_text())):
        return f"{target}: no heading #{anchor} in {file.name}"
    return None


def test_every_internal_link_resolves():
    problems = [f"{_name(page)}: {problem}" for page in PAGES for target in links(page.read_text())
                if (problem := check_link(page, target))]
    assert problems == []


def test_the_link_check_catches_what_it_guards():
    readme, planning = ROOT / "README.md", ROOT / "docs" / "planning.md"
    assert links("[a](docs/planning.md) `[b](nothing.md)` [c](#x \"t\")\n[d]: e.md\n<https://x.org>") == [
        "docs/planning.md", "#x", "e.md", "https://x.org"]
    assert check_link(readme, "docs/planning.md#honest-margins-until-calibrated") is None
    assert check_link(planning, "../README.md#quickstart") is None
    assert check_link(planning, "#zerotrain-plan") is None
    assert check_link(readme, "docs/planing.md")
    assert check_link(readme, "docs/planning.md#honest-margin")
    assert check_link(readme, "https://example.org/")
    assert anchors("# A `b`: c, d!\n## A `b`: c, d!\n```\n# not a heading\n```\n") == {"a-b-c-d", "a-b-c-d-1"}


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(README)}
    assert [_name(page) for page in PAGES[1:] if page.resolve() not in linked] == []


def test_the_readme_stays_a_first_page():
    assert len(README.splitlines()) < 260, "move the detail to a page under docs/ and link it"


def families_table(readme: str) -> dict[str, list[str]]:
    """The README's families table: each row's family, by the modules its second column names."""
    table = readme.partition("<!-- families table -->")[2].partition("<!-- end families table -->")[0]
    rows = [line.split("|")[1:-1] for line in table.strip().splitlines()[2:]]
    return {row[0].strip(): re.findall(r"`([^`]+\.py)`", row[1]) for row in rows}


def test_every_family_has_its_row_in_the_readmes_families_table():
    from zerotrain.families import all_families

    modules = {module for named in families_table(README).values() for module in named}
    files = {f"{type(family).__module__.rpartition('.')[2]}.py" for family in all_families()}
    assert sorted(files - modules) == [], "a family without its row in the README's families table"
    assert len(families_table(README)) == len(all_families())


def test_the_families_table_check_catches_what_it_guards():
    table = "<!-- families table -->\n| family | module |\n| --- | --- |\n| A | `a.py`, `parts/b.py` |\n<!-- end families table -->"
    assert families_table(table) == {"A": ["a.py", "parts/b.py"]}
    assert families_table(table.replace("| A | `a.py`, `parts/b.py` |\n", "")) == {}
