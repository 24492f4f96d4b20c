"""The documentation's checkable promises: docs/architecture.md's ownership table names paths that
exist, and README.md stays a user's page (short, no internal issue numbers, no links out of the
repository, the Quick start's two commands)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
TABLE_HEADER = "| Behaviour (README) | Owner module |"
MAX_README_LINES = 300
EXPERIMENTS_README = ROOT / "experiments" / "README.md"
MAX_EXPERIMENTS_README_LINES = 250
MIN_ROWS = 15


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def ownership_rows() -> list[tuple[str, str]]:
    """(behaviour, owner cell) of every row of the ownership table, in order."""
    lines = ARCHITECTURE.read_text().splitlines()
    start = lines.index(TABLE_HEADER)  # ValueError: the table's header is missing or changed
    assert re.fullmatch(r"\|(\s*:?-+:?\s*\|){2}", lines[start + 1].strip()), "the header needs a separator row"
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip().startswith("|"):
            break
        cells = _cells(line)
        assert len(cells) == 2, f"a row has two cells (behaviour | owner): {line!r}"
        rows.append((cells[0], cells[1]))
    return rows


def owner_path(cell: str) -> str:
    """The one repository-relative path an owner cell holds, in backticks and nothing else."""
    paths = re.findall(r"`([^`]+)`", cell)
    assert len(paths) == 1 and cell == f"`{paths[0]}`", f"an owner cell holds exactly one `path`: {cell!r}"
    return paths[0]


def quick_start_commands() -> list[str]:
    """The commands of README's Quick start code block, comments dropped."""
    text = README.read_text()
    section = text[text.index("## Quick start") :]
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section, re.S)
    assert block, "README's Quick start has a code block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


def test_the_ownership_table_has_a_row_per_behaviour():
    rows = ownership_rows()
    assert len(rows) >= MIN_ROWS, f"{len(rows)} rows; README describes more behaviours than that"
    for behaviour, owner in rows:
        assert behaviour, f"a row without a behaviour: owner {owner!r}"
        owner_path(owner)


def test_every_owner_path_exists():
    missing = []
    for behaviour, owner in ownership_rows():
        path = owner_path(owner)
        assert not path.startswith(("/", "../")) and ".." not in Path(path).parts, (
            f"{path!r} ({behaviour}): a path inside the repository, relative to its root"
        )
        target = ROOT / path
        exists = target.is_dir() if path.endswith("/") else target.is_file()
        if not exists:
            missing.append(f"{path} ({behaviour})")
    assert not missing, "docs/architecture.md's owner table names paths that do not exist: " + "; ".join(missing)


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (limit {MAX_README_LINES}): move measurements "
        "to experiments/README.md, design to docs/architecture.md, "
        "status to docs/status.md"
    )


def test_the_measurements_page_holds_today_s_numbers_not_the_history():
    lines = len(EXPERIMENTS_README.read_text().splitlines())
    assert lines <= MAX_EXPERIMENTS_README_LINES, (
        f"experiments/README.md has {lines} lines (limit {MAX_EXPERIMENTS_README_LINES}): it holds the "
        "reference numbers; superseded runs and before/after comparisons go to docs/experiments-log.md"
    )


def test_the_readme_names_no_issue_numbers():
    found = re.findall(r".{0,30}issues? \d.{0,30}", README.read_text(), re.I)
    assert not found, f"README.md refers to issue numbers its readers cannot see: {found}"


def _anchors(page: Path) -> set[str]:
    """The anchors of a markdown page's headings, as GitHub makes them (lower case, punctuation dropped,
    spaces as hyphens)."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_link_to_a_section_finds_its_heading():
    """A measurement moved from one page to another (experiments/README.md keeps today's numbers only, the
    rest goes to the log) must not leave links to a section that is gone."""
    pages = [README, EXPERIMENTS_README, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            linked = (page.parent / target).resolve() if target else page
            if linked.suffix == ".md" and linked.exists() and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)} -> {target}#{anchor}")
    assert not broken, "links to headings that do not exist: " + "; ".join(broken)


def test_the_readme_links_nothing_outside_the_repository():
    found = re.findall(r".{0,30}\.\./.{0,30}", README.read_text())
    assert not found, f"README.md points outside the repository: {found}"


def test_the_quick_start_is_the_two_make_commands():
    assert quick_start_commands() == ["make demo", "make test"]


def test_the_checks_catch_what_they_are_for():
    assert _cells("| a `x` | `fusionflow/` |") == ["a `x`", "`fusionflow/`"]
    assert owner_path("`fusionflow/loader/front.py`") == "fusionflow/loader/front.py"
    for bad in ("`a.py`, `b.py`", "`a.py` (the loader)", "fusionflow/loader/front.py", "``"):
        try:
            owner_path(bad)
        except AssertionError:
            continue
        raise AssertionError(f"owner_path accepted {bad!r}")
    assert re.search(r"issues? \d", "see (Issues 2, 11)", re.I) and re.search(r"issues? \d", "issue 16", re.I)


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def test_the_torchvision_drop_in_diff_is_the_two_loader_lines():
    """README's diff for torchvision's train.py: the import and each DataLoader( call renamed -- what
    the script needs, because FusionFlowLoader adopts a torchvision ImageFolder and its transform
    (tests/test_dropin.py runs that)."""
    changed = [line for line in _blocks("diff")[0].splitlines() if line[:1] in "+-"]
    assert changed[0] == "+import fusionflow" and len(changed) == 5, changed
    for minus, plus in zip(changed[1::2], changed[2::2]):
        assert minus.startswith("-") and "torch.utils.data.DataLoader(" in minus, minus
        assert plus[1:] == minus[1:].replace("torch.utils.data.DataLoader(", "fusionflow.FusionFlowLoader("), plus
    assert "the two loader lines" in README.read_text()


def test_the_timm_section_is_one_import_with_timm_s_signature():
    """README's diff for timm's train.py adds one import; the imported create_loader takes every argument
    timm's does, with timm's defaults (tests/test_timm_loader.py runs train.py's calls through it)."""
    import inspect

    timm_data = __import__("pytest").importorskip("timm.data")
    diff = next(b for b in _blocks("diff") if "timm" in b)
    changed = [line for line in diff.splitlines() if line[:1] in "+-"]
    assert changed == ["+from fusionflow.timm import create_loader"], changed
    from fusionflow.timm import create_loader

    ours = inspect.signature(create_loader).parameters
    for name, p in inspect.signature(timm_data.create_loader).parameters.items():
        assert name in ours and ours[name].default == p.default, name
