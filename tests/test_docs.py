"""The documentation site (mkdocs.yml, docs/): it builds with --strict (every page of the nav, every link and
anchor), its generated reference pages cover every config field, command and metric, the examples in its pages
are true, and it works in a real browser with no network.

Markers on code fences (docs/_hooks.py removes them before rendering):
- ```` ```yaml config ````: a complete run config; validated here with `load_config`, relative paths against
  the repository root;
- ```` ```bash runnable ````: each line is run here, in order, page by page, from a copy of the repository's
  `examples/` (with `runs/tiny-model`, the tiny model `rlft tiny-model` makes), with the virtual environment's
  bin first on PATH and OMP_NUM_THREADS=1; `rlft train|pipeline|eval|data` lines are shortened the way
  tests/test_examples.py shortens the shipped examples (a few steps, a few evaluated rows).
A plain ```` ```yaml ```` or ```` ```bash ```` block is shown and never checked: use it for fragments and for
commands that take minutes (`make demo`) or change the machine (`pip install`).

RLFT_DOCS_SCREENSHOTS=1 copies the browser test's screenshots to docs/screenshots/ (ignored by git) for a
person to look at.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from conftest import command_lines, run_main

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BIN = Path(sys.executable).parent  # the virtual environment's bin: mkdocs and rlft live beside this python


def _load(name: str, path: Path):
    """A module of docs/ (not a package), registered so its dataclasses resolve their own module."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


hooks = _load("rlft_docs_hooks", DOCS / "_hooks.py")
figures = _load("rlft_docs_figures", DOCS / "figures.py")


def _pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "screenshots" not in p.parts)


def _nav_pages() -> list[str]:
    """The page paths of mkdocs.yml's nav (its other tags, e.g. !!python/name, are not needed here)."""
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    out: list[str] = []

    def walk(node) -> None:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, list):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)

    walk(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"])
    return out


def _blocks(marker: str) -> list[tuple[Path, hooks.Block]]:
    return [(page, block) for page in _pages() for block in hooks.fenced_blocks(page.read_text())
            if block.info.split()[1:2] == [marker]]


def _id(page: Path, block: hooks.Block | None = None) -> str:
    where = str(page.relative_to(DOCS))
    return f"{where}:{block.line}" if block else where


# -- the site builds -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built_site(tmp_path_factory, request) -> Path:
    """`mkdocs build --strict` of the repository's docs into a temporary folder, timed."""
    out = tmp_path_factory.mktemp("docs") / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    pages = len(list(out.rglob("*.html")))
    # printed past pytest's capture, so -q shows it too: how long the docs take is worth seeing in `make test`
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print(f"\nmkdocs build --strict: {seconds:.1f} s, {pages} HTML pages")
    return out


def _html(site: Path, page: str) -> str:
    """The built HTML of a docs/ page path (use_directory_urls: guides/rewards.md -> guides/rewards/index.html)."""
    stem = page.removesuffix(".md")
    path = site / ("index.html" if stem == "index" else
                   f"{stem.removesuffix('/index')}/index.html" if stem.endswith("/index") else f"{stem}/index.html")
    return path.read_text()


def test_the_site_builds_strict_with_every_nav_page_and_reference(built_site):
    site = built_site
    for page in _nav_pages():
        assert "<article" in _html(site, page), page
    config = _html(site, "reference/config.md")
    for field in hooks.config_fields():  # every field, each with the anchor guides link to
        assert f'id="{field.anchor}"' in config, field.key
    assert 'id="algorithm-kl_coef"' in config and 'id="eval-suites-sampling-temperature"' in config
    cli = _html(site, "reference/cli.md")
    for command in hooks.cli_commands():
        assert " ".join(command.path) in cli, command.path
        for param in hooks.cli_params(command.command):
            names = param.opts if param.param_type_name == "option" else [param.name]
            assert any(f"<code>{n}" in cli or f"<code>[{n}" in cli or f"<code>{{{n}" in cli for n in names), \
                (command.path, param.name)
    metrics = _html(site, "reference/metrics.md")
    for name in ("reward/mean", "policy/approx_kl", "kl", "eval/accuracy", "rm/accuracy", "loss_scale"):
        assert f"<code>{name}</code>" in metrics, name
    api = _html(site, "reference/api.md")
    for name in ("api.train", "api.resume", "rewards.scoring.RewardFn", "rewards.scoring.register_reward",
                 "rollout.contract.Engine", "rollout.contract.Completion", "rollout.contract.SamplingParams",
                 "rollout.agent.environments.Environment", "rollout.agent.tools.calculator"):
        assert f'id="rlft.{name}"' in api, name


def test_every_fence_rendered_and_nothing_is_fetched_from_the_internet(built_site):
    """A fence the renderer did not take shows its backticks in a paragraph; and a page that loads a script,
    style, font or image from another host does not work offline (the browser test also blocks the network)."""
    site = built_site
    external = re.compile(r"""<(?:script|img|iframe|source)\b[^>]*\bsrc=["'](?:https?:)?//|"""
                          r"""<link\b[^>]*\bhref=["'](?:https?:)?//""", re.IGNORECASE)
    for path in site.rglob("*.html"):
        text = path.read_text()
        assert not re.search(r"<p>[^<]*```", text), path
        assert not external.search(text), (path, external.search(text)[0])
    for path in site.rglob("*.css"):
        assert not re.search(r"@import\s+url\(\s*[\"']?(?:https?:)?//", path.read_text()), path


# -- what the pages show is true ---------------------------------------------------------------------------

CONFIG_BLOCKS = _blocks("config")


@pytest.mark.parametrize("page, block", CONFIG_BLOCKS or [pytest.param(None, None, marks=pytest.mark.skip(
    reason="no ```yaml config block in docs/ yet"))], ids=[_id(p, b) for p, b in CONFIG_BLOCKS] or ["none"])
def test_yaml_config_blocks_are_complete_valid_configs(page, block, monkeypatch):
    from rlft.config import load_config, load_yaml

    monkeypatch.chdir(ROOT)  # the pages' relative paths (examples/...) are the repository's
    raw = load_yaml(block.body, f"{_id(page, block)}")  # a key given twice is an error here, as in a file
    assert isinstance(raw, dict), f"{_id(page, block)}: a config is a mapping of sections"
    load_config(raw)


# Commands a test cannot run: they take minutes, install things or reach the network.
NOT_RUNNABLE = {"make": "make targets build environments and take minutes", "pip": "installs packages",
                "apt-get": "installs packages", "apt": "installs packages", "sudo": "changes the machine",
                "git": "reaches the network or changes the checkout", "curl": "reaches the network",
                "wget": "reaches the network"}
SHELL = re.compile(r"[|&;<>()$`*?]")  # a line that needs the shell runs under bash, as written


def _lines(block: hooks.Block) -> list[str]:
    return command_lines(block.body)


def _shortened(argv: list[str], cwd: Path) -> list[str]:
    """What the test adds to an rlft command so it runs in seconds (the examples' shortening)."""
    from test_examples import shortening

    command = argv[1] if len(argv) > 1 else ""
    if command == "train" and "--resume" in argv:
        return []  # a resumed run keeps its own schedule
    if command == "train":
        config = next((a for a in argv[2:] if a.endswith((".yaml", ".yml"))), None)
        if config and (cwd / config).is_file():
            return shortening(yaml.safe_load((cwd / config).read_text()), cwd)
    if command == "pipeline" or argv[1:3] in (["data", "screen"], ["data", "pairs"]) or command == "train":
        return ["training.max_steps=2", "training.num_threads=1", "logging.progress=false", "eval.max_examples=4",
                "eval.max_new_tokens=8", "rollout.group_size=2", "rollout.prompts_per_step=2",
                "rollout.max_new_tokens=8"]
    if command == "eval":
        return [*(["--max-examples", "4"] if "--max-examples" not in argv else []),
                *(["--max-new-tokens", "8"] if "--max-new-tokens" not in argv else [])]
    return []


RUNNABLE_PAGES = sorted({page for page, _ in _blocks("runnable")})


@pytest.mark.parametrize("page", RUNNABLE_PAGES or [pytest.param(None, marks=pytest.mark.skip(
    reason="no ```bash runnable block in docs/ yet"))], ids=[_id(p) for p in RUNNABLE_PAGES] or ["none"])
def test_bash_runnable_blocks_run(page, tmp_path, monkeypatch, capsys, qwen_path):
    """A page's runnable lines in order, in one folder, as a reader following the page would run them."""
    work = tmp_path / "repo"
    shutil.copytree(ROOT / "examples", work / "examples")
    lines = [line for where, block in _blocks("runnable") if where == page for line in _lines(block)]
    makes_it = any(shlex.split(line, comments=True)[:2] == ["rlft", "tiny-model"] for line in lines)
    if any("runs/tiny-model" in line for line in lines) and not makes_it:
        # made on an earlier page by `rlft tiny-model runs/tiny-model`: the same model (build_tiny_model, qwen2,
        # seed 0), copied so that nothing a page runs can change the session's own
        shutil.copytree(qwen_path, work / "runs" / "tiny-model")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    cwd = work
    for line in lines:
        argv = shlex.split(line, comments=True)
        assert argv[0] not in NOT_RUNNABLE, f"{_id(page)}: {line!r}: {NOT_RUNNABLE[argv[0]]}; use a plain ```bash block"
        assert argv[:2] != ["rlft", "demo"], f"{_id(page)}: {line!r} takes minutes; use a plain ```bash block"
        if argv[0] == "cd" and len(argv) == 2:  # each line runs on its own: a cd holds for the lines after it
            cwd = (cwd / argv[1]).resolve()
            continue
        if argv[0] == "export" and len(argv) == 2 and "=" in argv[1]:
            key, _, value = argv[1].partition("=")
            env[key] = value
            continue
        if argv[0] == "rlft" and not SHELL.search(line):  # in this process, as the README's commands are run
            monkeypatch.chdir(cwd)
            done = run_main(monkeypatch, capsys, *argv[1:], *_shortened(argv, cwd))
        else:
            done = subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (_id(page), line, (done.stdout + done.stderr)[-3000:])


def test_the_markers_are_found_and_removed_before_rendering():
    text = ("Intro\n\n```yaml config\nmethod: sft\n```\n\n!!! note\n\n    ```bash runnable title=\"x\"\n"
            "    rlft --help\n    ```\n\n````markdown\n```yaml config\nnot: a block\n```\n````\n")
    blocks = hooks.fenced_blocks(text)
    assert [(b.info, b.body) for b in blocks] == [("yaml config", "method: sft\n"),
                                                  ('bash runnable title="x"', "rlft --help\n"),
                                                  ("markdown", "```yaml config\nnot: a block\n```\n")]
    stripped = hooks.strip_markers(text)
    assert "```yaml\nmethod" in stripped and '    ```bash title="x"' in stripped


def test_docstring_lists_get_the_blank_line_markdown_needs():
    griffe_ext = _load("rlft_docs_griffe", DOCS / "_griffe.py")
    text = "A reward is:\n- `prompt` is the question;\n  more of it\n- `row` the rest.\nAfter.\n\n- ok"
    assert griffe_ext.separate_lists(text) == ("A reward is:\n\n- `prompt` is the question;\n  more of it\n"
                                               "- `row` the rest.\nAfter.\n\n- ok")


def test_every_config_field_and_cli_parameter_is_described():
    """The reference pages are only as good as the descriptions they are made from."""
    missing = [f"config field {f.key}" for f in hooks.config_fields()
               if f.kind == "value" and not (f.field.description or "").strip()]
    for command in hooks.cli_commands():
        name = " ".join(command.path)
        if not (command.command.help or "").strip():
            missing.append(f"command {name!r} (help=...)")
        for param in hooks.cli_params(command.command):
            if not (getattr(param, "help", None) or "").strip():
                missing.append(f"{name} {param.param_type_name} {param.name!r} (help=...)")
    assert not missing, "no description: " + "; ".join(missing)


def test_every_config_section_has_a_docstring_its_reference_section_opens_with():
    """Each section of the config page (`model`, `data.train[]`, `eval.suites[].sampling`, ..., as the hook walks
    them) opens with its class's own docstring: what the section controls, when to touch it, the guide that
    explains it. A monitor detector's settings are that function's arguments, so its docstring stands in."""
    from rlft.monitor.detectors import DETECTORS

    page = hooks.config_reference()
    missing, not_shown = [], []
    for f in hooks.config_fields():
        if f.kind == "value":
            continue
        doc = f.section.__dict__.get("__doc__") or ""  # its own: not pydantic's, nor a parent section's
        if not doc.strip() and f.key.startswith("monitor."):
            doc = getattr(DETECTORS.get(f.key.split(".", 1)[1]), "__doc__", None) or ""
        if not doc.strip():
            missing.append(f"{f.section.__module__}.{f.section.__qualname__} ({f.key})")
            continue
        first = hooks._paragraphs(inspect.cleandoc(doc).split("\n\n")[0], hooks.CONFIG_PAGE)
        intro = page.split(f"{{#{f.anchor}}}\n\n", 1)[1].split("\n\n", 1)[0]
        if first not in intro:
            not_shown.append(f.key)
    assert not missing, "config sections without a docstring: " + "; ".join(missing)
    assert not not_shown, "config sections whose reference section does not open with the docstring: " + \
        ", ".join(not_shown)


def test_docs_pages_named_in_config_prose_become_links():
    """A docstring or description names a guide by its path under docs/; the config page links it, titled."""
    text = hooks._text("See guides/rewards.md#the-contract, or guides/async.md; `guides/x.md` stays code.",
                       page=hooks.CONFIG_PAGE)
    assert text == ("See [Rewards › The contract](../guides/rewards.md#the-contract), or "
                    "[Asynchronous rollouts](../guides/async.md); `guides/x.md` stays code.")
    assert hooks._text("guides/rewards.md") == "guides/rewards.md"  # other pages: no links unless asked


# -- figures -------------------------------------------------------------------------------------------------

def test_the_figures_are_what_the_script_writes(tmp_path):
    assert (DOCS / "assets" / "pipeline.svg").read_text() == figures.pipeline_svg(), \
        "docs/assets/pipeline.svg differs from what docs/figures.py writes: run `.venv/bin/python docs/figures.py`"
    ET.fromstring((DOCS / "assets" / "demo-curves.svg").read_text())  # well-formed (a browser shows nothing else)
    demo = tmp_path / "demo"
    for run, rows in (("sft", [{"step": s, "loss": 6.0 / s} for s in range(1, 31)]),
                      ("grpo", [{"step": s, "reward/correct": min(1.0, 0.5 + s / 20)} for s in range(1, 11)])):
        (demo / "runs" / run).mkdir(parents=True)
        (demo / "runs" / run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (demo / "results.json").write_text('{"seed": 0, "heldout_size": 200, "base": {"heldout/accuracy": 0.0}, '
                                       '"sft": {"heldout/accuracy": 0.58}, "rl": {"heldout/accuracy": 1.0}}')
    svg = ET.fromstring(figures.demo_curves_svg(demo))
    assert len(svg.findall(".//{http://www.w3.org/2000/svg}polyline")) == 3  # loss, reward, its moving mean


# -- in a browser ----------------------------------------------------------------------------------------------

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# as tests/monitor/test_report_browser.py, and every host but this machine unresolvable: a page that fetches
# anything from the internet logs an error, which fails the test
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1000",
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"]
# the guide page to photograph: the first of these the docs have
GUIDES = ["guides/methods/grpo.md", "guides/rewards.md", "guides/config-and-data.md", "reference/config.md"]


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # the request log would fill the test output
        pass


def test_the_site_works_in_headless_chromium_and_search_finds_kl_coef(built_site, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    assert shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER), \
        "install the browser: apt-get install -y chromium chromium-driver (see the Makefile)"
    # the index the search box reads: the field's own section is there (the fallback if the UI changes)
    index = json.loads((built_site / "search" / "search_index.json").read_text())
    assert any(d["location"] == "reference/config/#algorithm-kl_coef" for d in index["docs"])

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(built_site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + [f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    shots = {}
    try:
        driver.set_page_load_timeout(60)
        wait = WebDriverWait(driver, 60)
        driver.get(base)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "article.md-content__inner img"))
        # the pipeline picture drew (an SVG that failed to load has no natural width)
        assert driver.execute_script("return [...document.querySelectorAll('article img')]"
                                     ".every(i => i.complete && i.naturalWidth > 0)")
        shots["home"] = driver.get_screenshot_as_png()
        guide = next(g for g in GUIDES if (DOCS / g).is_file())
        driver.get(base + guide.removesuffix(".md") + "/")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "article.md-content__inner h1"))
        shots["guide"] = driver.get_screenshot_as_png()

        driver.get(base)
        # the header's search box, as a reader clicks it (on a narrow window the magnifier opens it)
        box = driver.find_element(By.CSS_SELECTOR, "input.md-search__input")
        if not box.is_displayed():
            next(e for e in driver.find_elements(By.CSS_SELECTOR, "label[for='__search']") if e.is_displayed()).click()
        wait.until(lambda d: box.is_displayed())
        box.click()
        box.send_keys("kl_coef")
        # the results are redrawn as each typed letter narrows them: read them in one script call (no element
        # handle to go stale) until the field's own hit is there; the config reference must come first
        def hits(d):
            links = d.execute_script("return [...document.querySelectorAll('.md-search-result__item a')]"
                                     ".map(a => a.href)")
            found = [(urlsplit(link).path, urlsplit(link).fragment) for link in links]  # `?h=` asks to highlight
            return found if ("/reference/config/", "algorithm-kl_coef") in found else None

        wait.until(hits)
        time.sleep(1)  # the last letter's results replace those of the letters before it
        found = hits(driver)
        assert found and found[0][0] == "/reference/config/", found
        shots["search"] = driver.get_screenshot_as_png()
        driver.execute_script("document.querySelector(\".md-search-result__item a[href$='#algorithm-kl_coef']\")"
                              ".click()")
        wait.until(lambda d: d.execute_script("return location.hash") == "#algorithm-kl_coef")
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
    finally:
        driver.quit()
        server.shutdown()
    keep = os.environ.get("RLFT_DOCS_SCREENSHOTS") == "1"
    for name, png in shots.items():
        assert len(png) > 20_000, name  # a rendered page, not a blank one (a blank page is a few KB)
        (tmp_path / f"{name}.png").write_bytes(png)
        if keep:
            (DOCS / "screenshots").mkdir(exist_ok=True)
            (DOCS / "screenshots" / f"{name}.png").write_bytes(png)
