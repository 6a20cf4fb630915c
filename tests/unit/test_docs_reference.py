"""The API reference page lists every public name, and the manual's structure holds together."""

import os
import re

import unison
import unison.algorithms

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_api_reference_lists_every_public_name():
    listed = set(re.findall(r"^::: ([\w.]+)", read("docs/api.md"), flags=re.M))
    wanted = {f"unison.{n}" for n in unison.__all__} | {f"unison.algorithms.{n}" for n in unison.algorithms.__all__}
    missing = sorted(wanted - listed)
    assert not missing, f"add to docs/api.md: {', '.join('::: ' + m for m in missing)}"


def test_api_reference_lists_every_algorithm():
    listed = set(re.findall(r"^::: ([\w.]+)", read("docs/api.md"), flags=re.M))
    for name in unison.algorithms.names():
        cls = unison.algorithms.get(name)
        assert f"{cls.__module__}.{cls.__qualname__}" in listed, f"algorithm {name} is not in docs/api.md"


def test_every_page_is_in_the_site_navigation():
    nav = read("mkdocs.yml")
    pages = [f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")]
    assert pages and not [p for p in pages if f": {p}" not in nav], "add the page to nav in mkdocs.yml"


def test_readme_is_short_and_stays_inside_the_repository():
    text = read("README.md")
    assert len(text.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#\s]+)", text):
        if "://" in target:
            continue
        assert not target.startswith(".."), target
        assert os.path.exists(os.path.join(ROOT, target)), f"README.md links to {target}, which does not exist"


def test_code_block_markers():
    from tests.docs_blocks import parse

    text = "\n".join(
        [
            "```python",
            "print(1)",
            "```",
            "<!-- excerpt -->",
            "```python",
            "model(x)",
            "```",
            "<!-- run: torchrun -->",
            "",
            "```python",
            "import unison",
            "```",
            "- in a list:",
            "",
            "  ```text",
            "  output",
            "  ```",
            '```python\n--8<-- "examples/quickstart.py"\n```',
            "<!-- run: unison launch -->",
            "~~~py",
            "x = 1",
            "~~~",
        ]
    )
    got = [(b.line, b.how) for b in parse("page.md", text)]
    assert got == [
        (1, "python"),
        (5, "excerpt"),
        (10, "torchrun"),
        (15, "unrunnable"),
        (18, "example"),
        (22, "unison launch"),
    ]
    assert parse("page.md", text)[3].code == "output\n"  # the list's indentation is taken off


def test_every_result_is_in_the_benchmarks_page():
    page = read("docs/benchmarks.md")
    results = sorted(os.listdir(os.path.join(ROOT, "benchmarks", "results")))
    missing = [name for name in results if name not in page]
    assert not missing, f"docs/benchmarks.md names no command for {missing}: add a row to its table of figures"
    docs = os.listdir(os.path.join(ROOT, "docs"))
    assert not [f for f in docs if f.endswith((".json", ".png"))], (
        "results go in benchmarks/results/, images in docs/img/"
    )
