"""MkDocs hook: render the reST-isms of gradaccum's docstrings in Markdown, without editing them.

The docstrings are Google style but keep two habits that Markdown reads otherwise:

* doctest lines (``>>> f(1)`` and the output below them) outside an ``Examples:`` section, which
  Markdown turns into nested block quotes: they become ``pycon`` code blocks;
* Sphinx roles (``:func:`gradaccum.num_steps```, ``:class:`~gradaccum.WindowSampler```) and
  ``text::`` before a literal block: the roles become cross-references to the API page (optional
  ones, so a private name that has no entry renders as code), ``::`` becomes ``:``.

The preprocessor is added to the Markdown extensions before mkdocstrings reads them, so it runs on
every page and on every docstring mkdocstrings renders. Lines inside fenced code are left alone.

And one for the rendered pages: each line of a code block (a ``<span id="__span-...">``, from
``pymdownx.highlight``'s ``line_spans``) gets its indentation as ``--indent`` (in characters), which
docs/stylesheets/extra.css uses to wrap a long line under its own indentation, 4 columns further in,
instead of at column 0.
"""

from __future__ import annotations

import html
import re

from markdown import Extension
from markdown.preprocessors import Preprocessor
from mkdocs.plugins import event_priority

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`(~?)([\w.]+)`")
_FENCE = re.compile(r"^\s*(```|~~~)")
_PROMPT = re.compile(r"^(\s*)>>> ")
_LINE = re.compile(r'<span id="(__span-\d+-\d+)">(.*?)(?=<span id="__span-\d+-\d+">|</code>)', re.S)
_TAG = re.compile(r"<[^>]+>")


def _role(match: re.Match) -> str:
    short, name = match.group(1), match.group(2)
    title = name.rsplit(".", 1)[-1] if short else name
    identifier = name if "." in name else f"gradaccum.{name}"
    return f'<autoref identifier="{identifier}" optional><code>{title}</code></autoref>'


class _Docstrings(Preprocessor):
    def run(self, lines: list) -> list:
        out: list = []
        fenced = False
        i = 0
        while i < len(lines):
            line = lines[i]
            if _FENCE.match(line):
                fenced = not fenced
            if fenced:
                out.append(line)
                i += 1
                continue
            prompt = _PROMPT.match(line)
            if prompt:  # a doctest: its prompts and output, up to a blank line
                indent = prompt.group(1)
                out += ["", f"{indent}```pycon"]
                while i < len(lines) and lines[i].strip():
                    out.append(lines[i])
                    i += 1
                out += [f"{indent}```", ""]
                continue
            line = _ROLE.sub(_role, line)
            if line.rstrip().endswith("::") and not line.rstrip().endswith(":::"):
                line = line.rstrip()[:-1]
            out.append(line)
            i += 1
        return out


class _DocstringsExtension(Extension):
    def extendMarkdown(self, md) -> None:  # noqa: N802 - Markdown's API
        md.preprocessors.register(_Docstrings(md), "gradaccum_docstrings", 40)


@event_priority(100)  # before mkdocstrings copies the extension list for its own Markdown instance
def on_config(config):
    config.markdown_extensions.append(_DocstringsExtension())
    return config


def _indent(match: re.Match) -> str:
    text = html.unescape(_TAG.sub("", match.group(2))).expandtabs(4)
    indent = len(text) - len(text.lstrip(" "))
    return f'<span id="{match.group(1)}" style="--indent:{indent}">{match.group(2)}'


def on_page_content(html_text: str, **kwargs) -> str:
    """Each code line's indentation, for the stylesheet's hanging indent (see the module's docstring)."""
    return _LINE.sub(_indent, html_text)
