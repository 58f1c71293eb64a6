"""The learning site builds cleanly and shows what it promises.

`mkdocs build --strict` fails on a broken link, a missing anchor or a snippet file that does
not exist. The tests below also check that the home page carries the knowledge map, that a
chapter really contains code included from the source, and that every `--8<-- "path:section"`
include in the docs names a section that exists in its file.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS_DIR = REPO_ROOT / "docs"

# A whole-line snippet include, as pymdownx.snippets reads it; a leading `;` escapes it.
SNIPPET_INCLUDE = re.compile(r"""^[ \t]*(?P<escape>;*)-{1,}8<-{1,}[ \t]+(?P<quote>["'])(?P<target>.+?)(?P=quote)[ \t]*$""")
# The path/section split of a target: "minivllm/x.py:section" (line ranges are not used here).
SECTION_TARGET = re.compile(r"^(?P<path>.+?):(?P<section>[A-Za-z][-_0-9A-Za-z]*)$")

pytest.importorskip("mkdocs", reason="the docs need mkdocs (pip install -e '.[dev]')")
pytest.importorskip("material", reason="the docs need mkdocs-material (pip install -e '.[dev]')")


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Build the site once, strictly, into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # Snippet paths are relative to the working directory: build from the repository root.
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"`mkdocs build --strict` failed (exit {result.returncode}): a broken link, anchor or "
        f"snippet include in docs/.\n--- stderr ---\n{result.stderr}\n--- stdout ---\n{result.stdout}"
    )
    return out


def page_text(site: Path, page: str) -> str:
    """The visible text of a built page: tags stripped (code is split into highlight spans)."""
    raw = (site / page).read_text(encoding="utf-8")
    return html.unescape(re.sub(r"<[^>]+>", "", raw))


def test_site_builds_strictly(site_dir: Path) -> None:
    assert (site_dir / "index.html").exists(), "the build produced no index.html"


def test_home_page_is_the_knowledge_map(site_dir: Path) -> None:
    text = page_text(site_dir, "index.html")
    for term in ["PagedAttention", "连续批处理", "Continuous batching", "前缀缓存", "推测解码", "张量并行", "not there yet"]:
        assert term in text, f"the home page should carry the knowledge map, but {term!r} is missing"
    for group in ["系统架构", "调度与缓存", "执行与模型", "量化与加速", "多模态与分布式", "服务与部署"]:
        assert group in text, f"the knowledge map should have the notes' group {group!r}"


def test_chapter_01_includes_real_source_code(site_dir: Path) -> None:
    text = page_text(site_dir, "chapters/01-architecture/index.html")
    # Each string exists only in the source files the chapter includes, never in its prose.
    for code in [
        "def step(self) -> list[EngineCoreOutput]:",  # minivllm/engine/core.py:step
        "engine_core_outputs = self.engine_core.get_output()",  # minivllm/engine/llm_engine.py:engine-step
        "class SchedulerConfig:",  # minivllm/config.py:scheduler-config
        "while engine.has_unfinished_requests():",  # minivllm/entrypoints/llm.py:run-engine
    ]:
        assert code in text, f"chapter 01 should show code included from the source, but {code!r} is missing"
    assert "--8<--" not in text, "a snippet marker leaked into chapter 01: an include did not resolve"


def snippet_includes() -> list[tuple[Path, int, str]]:
    """Every unescaped `--8<-- "target"` line in the docs: (file, line number, target)."""
    found = []
    for md in sorted(DOCS_DIR.rglob("*.md")):
        for number, line in enumerate(md.read_text(encoding="utf-8").splitlines(), start=1):
            m = SNIPPET_INCLUDE.match(line)
            if m and not m.group("escape"):
                found.append((md, number, m.group("target").strip()))
    return found


def test_docs_include_source_code() -> None:
    assert snippet_includes(), "no snippet include found in docs/: the chapters should include real code"


def test_every_snippet_section_exists() -> None:
    missing = []
    for md, number, target in snippet_includes():
        m = SECTION_TARGET.match(target)
        if m is None:
            continue  # a whole file: mkdocs' check_paths covers it
        path, section = REPO_ROOT / m.group("path"), m.group("section")
        where = f"{md.relative_to(REPO_ROOT)}:{number}"
        if not path.is_file():
            missing.append(f"{where}: file {m.group('path')} does not exist")
            continue
        source = path.read_text(encoding="utf-8")
        for kind in ("start", "end"):
            if not re.search(rf"-{{1,}}8<-{{1,}}[ \t]+\[[ \t]*{kind}[ \t]*:[ \t]*{re.escape(section)}[ \t]*\]", source):
                missing.append(f"{where}: {m.group('path')} has no [{kind}:{section}] marker")
    assert not missing, "snippet includes name sections that do not exist:\n" + "\n".join(missing)


def test_every_source_include_sits_in_a_code_fence() -> None:
    # A bare include of Python is pasted in as markdown: its comments become headings and its
    # code a paragraph. Each one must be the only line of a ``` fence opened just above it.
    bare = []
    for md, number, target in snippet_includes():
        section = SECTION_TARGET.match(target)
        if not (section.group("path") if section else target).endswith(".py"):
            continue
        lines = md.read_text(encoding="utf-8").splitlines()
        above, below = lines[number - 2].strip(), lines[number].strip() if number < len(lines) else ""
        if not (above.startswith("```") and below == "```"):
            bare.append(f"{md.relative_to(REPO_ROOT)}:{number}: {target}")
    assert not bare, "source includes outside a code fence (they render as prose):\n" + "\n".join(bare)


def test_included_code_is_rendered_as_code(site_dir: Path) -> None:
    # The symptom of a bare include in the built site: a `def` or `class` line in a paragraph,
    # or an `# exercise[...]` comment turned into a heading.
    prose_code = re.compile(r'<p>(?:def|class|async def) \w+|<h1 id="exercise')
    broken = [str(page.relative_to(site_dir)) for page in sorted(site_dir.rglob("*.html"))
              if prose_code.search(page.read_text(encoding="utf-8"))]
    assert not broken, f"pages that show included source as prose: {broken}"
