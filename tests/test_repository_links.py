"""Links to the repository and between the documents: built from one setting, pointing at files that exist.

The repository's address is written once, `REPOSITORY` / `BRANCH` in ultrascale.series.build
(the Colab badge and the notebooks' install cell are made from it). Every link to the
repository in README.md, docs/*.md and the notebooks must agree with it, and a link to a
file (github.com/OWNER/NAME/blob/BRANCH/PATH, its Colab or raw form) must name a file of this
tree; relative links in README and docs must resolve to existing files. Nothing is fetched:
the tree at hand is what the links will point to once it is published.
"""

import glob
import json
import os
import re

from ultrascale.series.build import BRANCH, REPOSITORY, colab_badge, repository_url, setup_source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWNER, NAME = REPOSITORY.split("/")

# A GitHub address in any of its forms: the page of a file or folder, Colab's view of a notebook, the raw
# file, or pip's git+https (with @REF).
GITHUB = re.compile(
    r"(?:git\+)?https?://(?:colab\.research\.google\.com/github/|raw\.githubusercontent\.com/|github\.com/)"
    r"(?P<owner>[\w.-]+)/(?P<name>[\w.-]+?)(?:\.git)?"
    r"(?:@(?P<ref>[\w./-]+)|/(?:(?P<kind>blob|tree)/)?(?P<rest>[^\s)\"'<>\]]*))?(?=[\s)\"'<>\]]|$)")
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)|^\[[^\]]+\]:\s*(?P<ref>\S+)",
                           re.M)


def documents() -> dict:
    """path relative to the root -> text: README, docs, and the notebooks' cells (their sources)."""
    out = {}
    for path in ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            out[os.path.relpath(os.path.join(ROOT, path), ROOT)] = f.read()
    for path in sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb"))):
        with open(path, encoding="utf-8") as f:
            cells = json.load(f)["cells"]
        out[os.path.relpath(path, ROOT)] = "\n".join("".join(c["source"]) for c in cells)
    return out


def repository_link_problems(text: str, where: str, root: str = ROOT) -> list[str]:
    """One line per link to this repository (one named NAME, whoever the owner) that is not built from
    the setting or points at no file here."""
    problems = []
    for m in GITHUB.finditer(text):
        url, owner, name = m.group(0), m.group("owner"), m.group("name")
        if name.lower() != NAME.lower() and f"{owner}/{name}" != REPOSITORY:
            continue  # another project
        if f"{owner}/{name}" != REPOSITORY:
            problems.append(f"{where}: {url} names {owner}/{name}; the repository is {REPOSITORY}")
            continue
        ref, rest = m.group("ref"), m.group("rest") or ""
        if m.group("kind") or "raw.githubusercontent.com" in url:  # BRANCH/PATH follows
            ref, _, path = rest.partition("/")
            path = path.split("#")[0].split("?")[0]
            if path and not os.path.exists(os.path.join(root, path)):
                problems.append(f"{where}: {url} points to {path}, which is not in this tree")
        if ref is not None and ref != BRANCH:
            problems.append(f"{where}: {url} is on {ref}; the published branch is {BRANCH}")
    return problems


def relative_link_problems(text: str, path: str, root: str = ROOT) -> list[str]:
    problems = []
    for m in MARKDOWN_LINK.finditer(text):
        target = m.group("target") or m.group("ref")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL or an anchor of the same page
        file = os.path.normpath(os.path.join(root, os.path.dirname(path), target.split("#")[0]))
        if not os.path.exists(file):
            problems.append(f"{path}: the link {target} points to {os.path.relpath(file, root)}, which does not exist")
    return problems


def test_every_link_to_the_repository_is_built_from_the_setting_and_points_to_a_file_here():
    docs = documents()
    problems = [p for path, text in docs.items() for p in repository_link_problems(text, path)]
    assert not problems, "\n".join(problems)
    # What the notebooks hold is made from the setting: the badge names each notebook's own file.
    notebooks = {path: text for path, text in docs.items() if path.endswith(".ipynb")}
    assert notebooks
    for path, text in notebooks.items():
        assert colab_badge(os.path.basename(path)) in text, path
        assert f"git+{repository_url()}@{BRANCH}" in text and f"git+{repository_url()}@{BRANCH}" in setup_source()


def test_relative_links_in_readme_and_docs_resolve():
    problems = [p for path, text in documents().items() if path.endswith(".md")
                for p in relative_link_problems(text, path)]
    assert not problems, "\n".join(problems)


def test_a_link_off_the_setting_or_to_a_missing_file_is_named():
    here = f"https://github.com/{REPOSITORY}/blob/{BRANCH}"
    text = "\n".join([
        f"[ok]({here}/README.md)",
        f"[badge](https://colab.research.google.com/github/{REPOSITORY}/blob/{BRANCH}/notebooks/none.ipynb)",
        f"[fork](https://github.com/someone-else/{NAME}/blob/{BRANCH}/README.md)",
        f"[old branch](https://github.com/{REPOSITORY}/tree/dev/docs)",
        f"pip install 'ultrascale @ git+https://github.com/{REPOSITORY}@v0'",
        "[another project](https://github.com/huggingface/picotron)",
    ])
    problems = repository_link_problems(text, "X.md")
    assert len(problems) == 4, problems
    assert "points to notebooks/none.ipynb, which is not in this tree" in problems[0]
    assert f"names someone-else/{NAME}; the repository is {REPOSITORY}" in problems[1]
    assert f"is on dev; the published branch is {BRANCH}" in problems[2]
    assert f"is on v0; the published branch is {BRANCH}" in problems[3]
    assert relative_link_problems("[a](docs/series.md) [b](docs/nothing.md#x) [c](#top) [d](https://x.org)",
                                  "README.md") == [
        "README.md: the link docs/nothing.md#x points to docs/nothing.md, which does not exist"]
