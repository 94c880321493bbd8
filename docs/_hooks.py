"""MkDocs hooks (mkdocs.yml `hooks:`): the reference pages are generated from the code at build time, never
copied by hand, so they cannot fall behind it.

- `docs/reference/config.md`, `cli.md` and `metrics.md` each hold a marker line `<!-- rlft:generate NAME -->`
  that `on_page_markdown` replaces with the text made from the pydantic config models, the typer app and the
  metrics catalogue; a marker without a generator (or a generator whose page lost its marker) stops the build.
- Code fences may carry a marker word after the language, which tests/test_docs.py acts on and this hook
  removes before rendering (superfences takes any bare word there for an option and would not render the
  block at all): `yaml config` (a complete config: the tests validate it) and `bash runnable` (the tests run
  each line on the tiny model).

tests/test_docs.py imports this file for `fenced_blocks`, `config_fields` and `cli_commands`, so the tests walk
exactly what the pages show.
"""

from __future__ import annotations

import html
import inspect
import json
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, get_args, get_origin

# -- code-fence markers ------------------------------------------------------------------------------

MARKERS = ("config", "runnable")
_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
_MARKED = re.compile(r"^(?P<head>[ \t]*(?:`{3,}|~{3,})[ \t]*[\w.+#-]+)[ \t]+(?:" + "|".join(MARKERS) + r")\b")


@dataclass
class Block:
    info: str  # the info string as written, e.g. "yaml config"
    body: str  # the block's text, with the fence's indentation removed
    line: int  # 1-based line of the opening fence


def fenced_blocks(text: str) -> list[Block]:
    """Every fenced code block of a Markdown text, indented ones (in admonitions, lists) included."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opened = _FENCE_OPEN.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, fence = opened["indent"], opened["fence"]
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        body, j = [], i + 1
        while j < len(lines) and not close.match(lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        blocks.append(Block(opened["info"].strip(), "\n".join(body) + "\n", i + 1))
        i = j + 1
    return blocks


def strip_markers(markdown: str) -> str:
    """```` ```yaml config title="x" ```` -> ```` ```yaml title="x" ````: the language and real options stay."""
    return "\n".join(_MARKED.sub(r"\g<head>", line) for line in markdown.split("\n"))


# -- Markdown helpers --------------------------------------------------------------------------------

DOCS = Path(__file__).resolve().parent
# a docs page named in prose, as its path under docs/ (guides/rewards.md, guides/async.md#memory)
_DOC_PAGE = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md(?:#[\w-]+)?)(?![\w/])")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)(?:[ \t]+\{#([\w-]+)\})?[ \t]*$", re.MULTILINE)


def _literal(part: str) -> str:
    part = html.escape(part, quote=False)
    return re.sub(r"([*_{}\[\]\\])", r"\\\1", part)


def _page_link(target: str, page: str) -> str:
    """`guides/async.md#memory`, named on `page`: a link to it (relative, so --strict checks the page and the
    anchor), titled with the page's title and the anchor's heading: "Asynchronous rollouts › Memory"."""
    from markdown.extensions.toc import slugify

    path, _, anchor = target.partition("#")
    text = target
    source = DOCS / path
    if source.is_file():
        headings = [(m[1], m[2], m[3] or slugify(m[2].replace("`", ""), "-"))
                    for m in _HEADING.finditer(source.read_text())]
        title = next((h for level, h, _ in headings if level == "#"), path)
        heading = next((h for level, h, slug in headings if anchor and slug == anchor and level != "#"), None)
        text = title + (f" › {heading}" if heading else "")
    href = posixpath.relpath(path, posixpath.dirname(page) or ".") + (f"#{anchor}" if anchor else "")
    return f"[{_literal(text)}]({href})"


def _text(value: str, table: bool = False, page: str | None = None) -> str:
    """Prose from docstrings and help strings as Markdown shows it literally: `<name>` is not an HTML tag,
    `*` is not emphasis, `{...}` is not an attribute list; `code spans` stay code. With `page` (the docs/ path
    of the page it goes on), a docs page named outside code by its path under docs/ (`guides/rewards.md`,
    `guides/async.md#memory`) becomes a link to it, which --strict checks like any other."""
    parts = re.split(r"(`[^`]*`)", " ".join(value.split()))
    out = []
    for k, part in enumerate(parts):
        if k % 2 == 0:
            pieces = _DOC_PAGE.split(part) if page else [part]
            part = "".join(_page_link(p, page) if j % 2 else _literal(p) for j, p in enumerate(pieces))
        if table:  # a pipe would end the cell, in a code span too
            part = part.replace("|", "\\|")
        out.append(part)
    return "".join(out)


def _code(value: str) -> str:
    tick = "``" if "`" in value else "`"
    return f"{tick}{value}{tick}" if value else "`\"\"`"


def _yaml(value: Any) -> str:
    """A value as it is written in a config file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return value if value and re.fullmatch(r"[\w./@:+-]+", value) else json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


# -- config reference --------------------------------------------------------------------------------

@dataclass
class ConfigField:
    key: str  # as written in overrides: algorithm.kl_coef, eval.suites[].name
    anchor: str  # algorithm-kl_coef, eval-suites-name
    field: Any  # pydantic FieldInfo
    section: type | None  # the section class when the field's value is (a list of) sections
    kind: str  # "value": a setting; "section": a heading for a section; "items": the items of a value's list form
    see: str | None = None  # a value of sections described elsewhere (eval.suites[].rewards): that key


def anchor_of(key: str) -> str:
    return key.replace("[]", "").replace(".", "-")


def _is_section_only(field: Any, section: type | None) -> bool:
    """The field holds a section (or a list of them, or an optional one) and nothing else."""
    if section is None:
        return False
    args = get_args(field.annotation) or (field.annotation,)
    return all(a is type(None) or a is section or get_args(a) == (section,) for a in args)


def config_fields() -> Iterator[ConfigField]:
    """Every field of the run config in the order the page shows them: a section's own settings, then its
    sub-sections, each in declaration order. A list of sections (`rewards`, `eval.suites`) is walked once, its
    items' keys written `name[].field`; a section class met again (`eval.suites[].rewards`) is a value that
    points to where its fields are (`rewards`) instead of repeating them."""
    from rlft.config import Config, _section_type

    described: dict[type, str] = {}  # section class -> key of the heading its fields are under

    def walk(model: type, prefix: str) -> Iterator[ConfigField]:
        nested = []
        for name, field in model.model_fields.items():
            key = prefix + name
            sub = _section_type(field.annotation)
            if sub in described:
                yield ConfigField(key, anchor_of(key), field, None, "value", described[sub])
                continue
            if _is_section_only(field, sub):
                nested.append((key, field, sub))
                continue
            yield ConfigField(key, anchor_of(key), field, sub, "value")
            if sub is not None:  # data.train: a value, or a list of sections whose fields follow the others
                nested.append((key, field, sub))
        for key, field, sub in nested:
            args = get_args(field.annotation)
            many = get_origin(field.annotation) is list or any(get_origin(a) is list for a in args)
            if _is_section_only(field, sub):
                yield ConfigField(key, anchor_of(key), field, sub, "section")
                described.setdefault(sub, key)
            else:
                yield ConfigField(key + "[]", anchor_of(key) + "-items", field, sub, "items")
                described.setdefault(sub, key + "[]")
            yield from walk(sub, key + ("[]." if many else "."))

    yield from walk(Config, "")


def _literal_only(args: tuple) -> bool:
    """A union of one Literal and null: shown as its type with the values under Allowed."""
    real = [a for a in args if a is not type(None)]
    return len(real) == 1 and get_origin(real[0]) is Literal


def _type_text(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return "str" if all(isinstance(a, str) for a in args) else " | ".join(map(_yaml, args))
    if origin is list:
        return f"list[{_type_text(args[0])}]" if args else "list"
    if origin is dict:
        return f"dict[{_type_text(args[0])}, {_type_text(args[1])}]" if args else "dict"
    if args:  # a union; a Literal beside other types is written out: list[str] | "all-linear"
        inline = not _literal_only(args)
        return " | ".join(dict.fromkeys(" | ".join(json.dumps(v) for v in get_args(a))
                                        if inline and get_origin(a) is Literal else _type_text(a) for a in args))
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _choices(annotation: Any) -> str:
    """What a field accepts where the type says it: Literal values, also of list items and dict keys/values."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return ", ".join(_code(_yaml(a)) for a in args)
    if origin is list and args:
        inner = _choices(args[0])
        return f"each one of {inner}" if inner else ""
    if origin is dict and args:
        keys, values = _choices(args[0]), _choices(args[1])
        return "; ".join(([f"keys {keys}"] if keys else []) + ([f"values {values}"] if values else []))
    if args and _literal_only(args):
        return _choices(next(a for a in args if a is not type(None)))
    return ""


_BOUNDS = {"Ge": ("ge", "≥"), "Gt": ("gt", ">"), "Le": ("le", "≤"), "Lt": ("lt", "<")}


def _bounds(field: Any) -> str:
    parts = []
    for m in field.metadata:
        kind = type(m).__name__
        if kind in _BOUNDS:
            attr, sign = _BOUNDS[kind]
            parts.append(f"{sign} {_yaml(getattr(m, attr))}")
        else:  # a constraint this page does not know how to say: shown as pydantic states it
            parts.append(str(m))
    return ", ".join(parts)


def _by_method(values: dict[str, Any]) -> str:
    """{method: value} -> '`0.04` (grpo, ppo); `0` (dapo)': methods grouped by the value they use."""
    groups: dict[str, list[str]] = {}
    for method, value in values.items():
        groups.setdefault(_yaml(value), []).append(method)
    return "; ".join(f"{_code(v)} ({', '.join(ms)})" for v, ms in groups.items())


def _default(f: ConfigField) -> str:
    from rlft.config import _BASE_PRESET, METHOD_LEARNING_RATES, PRESETS

    if f.key == "training.learning_rate":
        return "by method: " + _by_method(METHOD_LEARNING_RATES)
    section, _, name = f.key.partition(".")
    if section == "algorithm" and name in _BASE_PRESET:  # filled from the method's preset at load time
        values = {m: {**_BASE_PRESET, **PRESETS[m]}[name] for m in PRESETS}
        if len({_yaml(v) for v in values.values()}) == 1:
            return f"{_code(_yaml(next(iter(values.values()))))} (online methods)"
        return "by method: " + _by_method(values)
    if f.field.is_required():
        return "required"
    return _code(_yaml(f.field.get_default(call_default_factory=True)))


def section_doc(section: type, key: str) -> str:
    """What a section is for, the intro under its heading: the class's own docstring (not pydantic's base
    one, nor a parent section's), else for a monitor detector its function's docstring (its settings are that
    function's arguments). tests/test_docs.py requires one for every section."""
    doc = section.__dict__.get("__doc__")
    if doc:
        return inspect.cleandoc(doc)
    if key.startswith("monitor."):
        from rlft.monitor.detectors import DETECTORS

        detector = DETECTORS.get(key.split(".", 1)[1])
        if detector is not None and detector.__doc__:
            return f"Health detector `{key.split('.', 1)[1]}`: " + inspect.cleandoc(detector.__doc__)
    return ""


def _section_text(f: ConfigField) -> str:
    """The intro of a section's heading: `section_doc`; the field's description (what `rlft config-help`
    prints beside the section's name) only where the class has no docstring."""
    return section_doc(f.section, f.key) or f.field.description or ""


CONFIG_PAGE = "reference/config.md"


def _paragraphs(text: str, page: str | None = None) -> str:
    return "\n\n".join(_text(p, page=page) for p in re.split(r"\n\s*\n", text) if p.strip())


def config_reference() -> str:
    fields = list(config_fields())
    anchors = [f.anchor for f in fields]
    duplicated = sorted({a for a in anchors if anchors.count(a) > 1})
    if duplicated:
        raise ValueError(f"config reference: anchors {duplicated} name more than one field")
    out = ["## Top level {#top-level}", ""]
    for f in fields:
        depth = f.key.replace("[]", "").count(".")
        if f.kind != "value":
            level = "##" if depth == 0 else "###"
            out += [f"{level} `{f.key}` {{#{f.anchor}}}", ""]
            notes = []
            if f.kind == "items":
                notes.append(f"The items of [`{f.key[:-2]}`](#{anchor_of(f.key[:-2])}) when it is a list.")
            if f.kind == "section" and not f.field.is_required() and f.field.get_default() is None:
                notes.append("Optional: `null` (the default) leaves it out.")
            text = _section_text(f)
            out += ([_paragraphs(text, CONFIG_PAGE), ""] if text else []) + ([" ".join(notes), ""] if notes else [])
            continue
        facts = [f"**Type** {_code(_type_text(f.field.annotation))}", f"**Default** {_default(f)}"]
        choices = _choices(f.field.annotation)
        facts += [f"**Allowed** {choices}"] if choices else []
        bounds = _bounds(f.field)
        if bounds:
            facts.append(f"**Range** {_code(bounds)}")
        out += [f"#### `{f.key}` {{#{f.anchor}}}", "", " · ".join(facts), ""]
        if f.field.description:
            out += [_paragraphs(f.field.description, CONFIG_PAGE), ""]
        if f.section is not None:
            out += [f"As a list, its items are [`{f.key}[]`](#{f.anchor}-items).", ""]
        if f.see is not None:
            anchor = anchor_of(f.see[:-2]) + "-items" if f.see.endswith("[]") else anchor_of(f.see)
            out += [f"Its items have the fields described under [`{f.see}`](#{anchor}).", ""]
    return "\n".join(out) + "\n" + _rewards_reference()


def _rewards_reference() -> str:
    """Each built-in reward (`rewards[].fn`) with its `args` and the first paragraph of its docstring."""
    from rlft.rewards import BUILTIN_REWARDS

    out = ["## Built-in rewards {#built-in-rewards}", "",
           "Names for [`rewards[].fn`](#rewards-fn); the arguments go in [`rewards[].args`](#rewards-args). "
           "Your own function is `module:function` or `file.py:function`, called as "
           "`fn(prompt, completion, **row)` (see [the reward contract](api.md#rewards)).", ""]
    for name in sorted(BUILTIN_REWARDS):
        factory = BUILTIN_REWARDS[name]
        summary = (inspect.getdoc(factory) or "").strip().split("\n\n")[0]
        out += [f"### `{name}` {{#reward-{name}}}", "", _text(summary), ""]
        params = [p for p in inspect.signature(factory).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if params:
            args = ", ".join(f"`{p.name}`" + (" (required)" if p.default is p.empty else f" = `{_yaml(p.default)}`")
                             for p in params)
            out += [f"**args** {args}", ""]
        else:
            out += ["**args** none", ""]
    return "\n".join(out)


# -- CLI reference -----------------------------------------------------------------------------------

@dataclass
class CliCommand:
    path: list[str]  # ["rlft", "data", "screen"]
    command: Any  # the click command (typer's vendored click)
    context: Any


def cli_commands() -> Iterator[CliCommand]:
    """Every command of the typer app, sub-groups walked, in the order `rlft --help` lists them."""
    import typer
    from typer.main import get_command

    from rlft.cli.app import app

    context_class = getattr(typer, "Context", None)

    def walk(command: Any, path: list[str], parent: Any) -> Iterator[CliCommand]:
        ctx = context_class(command, info_name=path[-1], parent=parent)
        yield CliCommand(path, command, ctx)
        if hasattr(command, "list_commands"):  # a group
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                if sub is not None and not getattr(sub, "hidden", False):
                    yield from walk(sub, path + [name], ctx)

    yield from walk(get_command(app), ["rlft"], None)


def cli_params(command: Any) -> list[Any]:
    """The arguments and options a user passes (not --help)."""
    return [p for p in command.params if not getattr(p, "hidden", False) and p.name != "help"]


def _param_row(p: Any, ctx: Any) -> str:
    """One table row: the parameter as `--help` shows it (`--data <str>`, `{target}`), its help, its notes."""
    is_option = p.param_type_name == "option"
    if is_option:  # typer's own rendering: names and value type
        names = ", ".join(_code(n.strip()) for n in p.get_help_record(ctx)[0].split(", "))
    else:
        names = _code(" ".join(p.get_usage_pieces(ctx)))
    notes = []
    if p.required:
        notes.append("required")
    if getattr(p, "multiple", False):
        notes.append("repeatable")
    low, high = getattr(p, "min", None), getattr(p, "max", None)
    if low is not None:
        notes.append(f"≥ {low}")
    if high is not None:
        notes.append(f"≤ {high}")
    if not is_option and getattr(p, "nargs", 1) == -1:
        notes.append("any number")
    default = p.default
    if default not in (None, False, ()) and not callable(default):
        notes.append(f"default {_code(_yaml(str(default) if not isinstance(default, (int, float)) else default))}")
    help_text = _text(getattr(p, "help", None) or "", table=True)
    return f"| {names} | {help_text} | {', '.join(notes)} |"


def cli_reference() -> str:
    out = []
    for c in cli_commands():
        name = " ".join(c.path)
        is_group = hasattr(c.command, "list_commands")
        if len(c.path) == 1:  # the app itself: its summary and its commands
            out += [_paragraphs(c.command.help or ""), ""]
            continue
        anchor = "-".join(c.path[1:])
        level = "##" if len(c.path) == 2 else "###"
        out += [f"{level} `{name}` {{#{anchor}}}", ""]
        usage = " ".join(c.command.collect_usage_pieces(c.context))
        out += ["```text", f"{name} {usage}".rstrip(), "```", ""]
        out += [_paragraphs(c.command.help or ""), ""]
        if is_group:
            subs = [f"[`{name} {s}`](#{anchor}-{s})" for s in c.command.list_commands(c.context)]
            out += ["Commands: " + ", ".join(subs) + ".", ""]
        params = cli_params(c.command)
        if params:
            out += ["| argument / option | meaning | notes |", "|---|---|---|"]
            out += [_param_row(p, c.context) for p in params]
            out.append("")
    return "\n".join(out)


# -- metrics reference -------------------------------------------------------------------------------

def _config_for(method: str, **changes: Any) -> Any:
    """A Config for the catalogue to list a run's metrics, built without validation: no model or data
    file needs to exist, and placeholder names (`<component>`) are allowed."""
    from rlft.config import (_BASE_PRESET, PRESETS, AgentConfig, AlgorithmConfig, Config, DataConfig, EvalConfig,
                             EvalSuite, ModelConfig, RewardSpec, RolloutConfig, TrainingConfig)

    algorithm = {**_BASE_PRESET, **PRESETS.get(method, {}), **changes.pop("algorithm", {})}
    parts = dict(method=method, output_dir="run", model=ModelConfig.model_construct(path="model"),
                 data=DataConfig.model_construct(train="train.jsonl", eval=changes.pop("eval_data", None)),
                 training=TrainingConfig().model_copy(update=changes.pop("training", {})),
                 rollout=RolloutConfig().model_copy(update=changes.pop("rollout", {})),
                 algorithm=AlgorithmConfig.model_construct(**algorithm),
                 rewards=[RewardSpec.model_construct(fn=r, name=None, weight=1.0, args={})
                          for r in changes.pop("rewards", ["math"])],
                 eval=EvalConfig().model_copy(update={"suites": [EvalSuite.model_construct(name=s)
                                                                 for s in changes.pop("suites", [])]}),
                 agent=AgentConfig.model_construct(tools=["calculator"]) if changes.pop("agent", False) else None)
    if changes.pop("mixed", False):
        parts["data"] = DataConfig.model_construct(train=[], eval=None)
    assert not changes, changes
    return Config.model_construct(**parts)


def _deep(changes: dict[str, Any]) -> dict[str, Any]:
    """A copy _config_for may pop from (the cases above are shared between builds)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in changes.items()}


def _metric_names(method: str, components: list[str] | None = None, **changes: Any) -> tuple[set[str], set[str]]:
    from rlft.monitor.catalogue import metric_names

    components = ["<component>"] if components is None else components
    names, prefixes = metric_names(_config_for(method, **changes), components)
    return set(names), set(prefixes)


# What each situation switches on: (anchor, title, the setting that does it (links into config.md), the
# changes that turn it on, the run it is compared with). Every case must add names, so a catalogue change
# that moves one shows up as a failed build instead of a page that quietly lists less.
_NO_KL = {"algorithm": {"kl_coef": 0.0}}
_ONLINE_CASES = [
    ("kl", "A KL term to the reference", "[`algorithm.kl_coef`](config.md#algorithm-kl_coef) > 0 (GRPO's default)",
     {"algorithm": {"kl_coef": 0.04}}, _NO_KL),
    ("tis", "Truncated importance sampling",
     "[`algorithm.rollout_correction`](config.md#algorithm-rollout_correction) is `tis`",
     {"algorithm": {"kl_coef": 0.0, "rollout_correction": "tis"}}, _NO_KL),
    ("dynamic-sampling", "Dynamic sampling (DAPO)",
     "[`algorithm.dynamic_sampling`](config.md#algorithm-dynamic_sampling) is true",
     {"algorithm": {"kl_coef": 0.0, "dynamic_sampling": True}}, _NO_KL),
    ("critic", "A critic (PPO)", "[`algorithm.advantage`](config.md#algorithm-advantage) is `gae` (method ppo)",
     {"algorithm": {"kl_coef": 0.0, "advantage": "gae"}}, _NO_KL),
    ("async", "Asynchronous rollouts", "[`rollout.async_steps`](config.md#rollout-async_steps) k > 0 (listed for "
     "k = 1 with `tis`: the `staleness_<s>` names repeat for s = 0 ... k)",
     {"algorithm": {"kl_coef": 0.0, "rollout_correction": "tis"}, "rollout": {"async_steps": 1}},
     {"algorithm": {"kl_coef": 0.0, "rollout_correction": "tis"}}),
    ("sft-mix", "An SFT loss mixed in", "[`algorithm.sft_mix`](config.md#algorithm-sft_mix) is set",
     {"algorithm": {"kl_coef": 0.0, "sft_mix": "sft.jsonl"}}, _NO_KL),
    ("ensemble", "A reward-model ensemble", "a [`reward_model_ensemble`](config.md#reward-reward_model_ensemble) "
     "reward is among the rewards", {**_NO_KL, "rewards": ["reward_model_ensemble"]}, _NO_KL),
    ("fp16", "fp16 loss scaling", "[`training.precision`](config.md#training-precision) is `fp16-mixed` "
     "(offline methods too)", {**_NO_KL, "training": {"precision": "fp16-mixed"}}, _NO_KL),
    ("held-out", "Held-out data", "[`data.eval`](config.md#data-eval) is set (`pass@k`: k = "
     "[`eval.num_samples`](config.md#eval-num_samples))", {**_NO_KL, "eval_data": "eval.jsonl"}, _NO_KL),
    ("suites", "Eval suites", "[`eval.suites`](config.md#eval-suites) are set: one prefix per suite",
     {**_NO_KL, "suites": ["<suite>"]}, _NO_KL),
    ("mixed-sources", "Mixed data sources", "[`data.train`](config.md#data-train) is a list of sources",
     {**_NO_KL, "mixed": True}, _NO_KL),
    ("agents", "Agents (tools, environments)", "an [`agent`](config.md#agent) section is set",
     {**_NO_KL, "agent": True, "eval_data": "eval.jsonl"}, {**_NO_KL, "eval_data": "eval.jsonl"}),
]

_PREFIX_NOTES = {
    "reward/<component>/": "the parts of a dict-valued reward, and numbers a reward reports with `Scored`",
    "agent/": "per step: turns, tool calls, error rates by kind (`agent/errors/<kind>`), tool latency, "
              "re-tokenisation drift",
    "env/": "per step: mean return and steps per episode, episodes the environment ended or that were cut, step "
            "timeouts, inserted observation tokens",
    "eval/agent/": "the same episode statistics on held-out data",
    "eval/env/": "the same environment statistics on held-out data",
    "eval/<suite>/": "accuracy, pass@k, maj@k, format compliance and length of that suite",
    "reward/source/": "train reward per data source",
    "accuracy/source/": "train accuracy per data source",
    "data/source/": "each source's share of the step's prompts",
}


def _name_table(names: set[str], described: dict[str, str]) -> list[str]:
    """Names grouped by their prefix (up to the last '/')."""
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        groups.setdefault(name.rpartition("/")[0] + "/" if "/" in name else "", []).append(name)
    rows = ["| prefix | metrics |", "|---|---|"]
    for prefix, members in sorted(groups.items()):
        shown = ", ".join(f"[`{n}`](#{_metric_anchor(n)})" if n in described else f"`{n}`" for n in members)
        rows.append(f"| `{prefix or '(none)'}` | {shown} |")
    return rows + [""]


def _metric_anchor(name: str) -> str:
    return "metric-" + re.sub(r"[^\w]+", "-", name).strip("-")


def metrics_reference() -> str:
    from rlft.monitor.catalogue import METRIC_DESCRIPTIONS

    described = dict(METRIC_DESCRIPTIONS)
    out = []
    methods = ["sft", "dpo", "reward_model", "grpo"]
    plain = {m: _metric_names(m, algorithm={"kl_coef": 0.0})[0] for m in methods}
    every = set.intersection(*plain.values())
    out += ["## Every run {#every-run}", "", "Logged by every method at each logged step.", ""]
    out += _name_table(every, described)

    base, base_prefixes = _metric_names("grpo", algorithm={"kl_coef": 0.0})
    out += ["## Online methods {#online}", "",
            "GRPO, Dr. GRPO, DAPO, RLOO, REINFORCE++, PPO, GSPO, CISPO and distillation log these at every "
            "step, and `reward/<component>` for each reward component (its name: "
            "[`rewards[].name`](config.md#rewards-name), else the function's).", ""]
    out += _name_table(base - every, described)
    if base_prefixes:
        out += ["And names under these prefixes, known at run time:", ""]
        out += [f"- `{p}...`: {_PREFIX_NOTES.get(p, 'names known at run time')}" for p in sorted(base_prefixes)]
        out += [""]
    for anchor, title, setting, changes, context in _ONLINE_CASES:
        names, prefixes = _metric_names("grpo", **_deep(changes))
        before, before_prefixes = _metric_names("grpo", **_deep(context))
        added, new_prefixes = names - before, prefixes - before_prefixes
        if not added and not new_prefixes:
            raise ValueError(f"metrics reference: {title!r} adds no metric; the catalogue changed: update "
                             "_ONLINE_CASES in docs/_hooks.py")
        out += [f"### {title} {{#online-{anchor}}}", "", f"When {setting}.", ""]
        if added:
            out += _name_table(added, described)
        for prefix in sorted(new_prefixes):
            out += [f"- `{prefix}...`: {_PREFIX_NOTES.get(prefix, 'names known at run time')}"]
        out += [""] if new_prefixes else []

    out += ["## Offline methods {#offline}", ""]
    offline_base = set.intersection(*(plain[m] for m in ("sft", "dpo", "reward_model"))) - every
    if offline_base:
        out += ["SFT, DPO and reward-model training all log:", ""] + _name_table(offline_base, described)
    for method in ("sft", "dpo", "reward_model"):
        with_eval, _ = _metric_names(method, [], **_deep(_NO_KL), eval_data="eval.jsonl")
        with_rewards, _ = _metric_names(method, ["<component>"], **_deep(_NO_KL), eval_data="eval.jsonl")
        out += [f"### `{method}` {{#offline-{method}}}", ""]
        own = plain[method] - every - offline_base
        if own:
            out += _name_table(own, described)
        if with_eval - plain[method]:
            out += ["With [`data.eval`](config.md#data-eval):", ""] + _name_table(with_eval - plain[method], described)
        if with_rewards - with_eval:
            out += ["With `data.eval` and [`rewards`](config.md#rewards) (generations scored):", ""]
            out += _name_table(with_rewards - with_eval, described)

    out += ["## What some metrics measure {#meanings}", "",
            "Where the name alone leaves it open, or frameworks differ on it:", ""]
    for name, text in described.items():
        out += [f"### `{name}` {{#{_metric_anchor(name)}}}", "", _text(text), ""]
    return "\n".join(out)


# -- the hook ----------------------------------------------------------------------------------------

GENERATORS = {"config": config_reference, "cli": cli_reference, "metrics": metrics_reference}
_MARKER = re.compile(r"^<!-- rlft:generate (\w+) -->$", re.M)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    def generate(match: re.Match) -> str:
        name = match[1]
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_uri}: no generator named {name!r} (known: {', '.join(GENERATORS)})")
        return GENERATORS[name]()

    markdown = _MARKER.sub(generate, markdown)
    return strip_markers(markdown)
