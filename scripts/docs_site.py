"""MkDocs hooks (mkdocs.yml): the pages read as they read on GitHub, with every link checked.

Links to the repository's files outside docs/. The pages link to files such as ``../deploy/README.md`` so that they work where the Markdown is
read in the repository. The site holds only docs/, so MkDocs would report such a link as not found;
this hook checks that the file exists, and that a Markdown file has the heading an ``#anchor`` names
(a link that fails either is a warning, which fails the strict build like any other broken link),
then writes the link as the file's path in the repository, or as a link to it under ``repo_url``
when mkdocs.yml names one.

Lists as GitHub reads them. GitHub starts a list right under a line of text and nests one indented
by two or three spaces; Python-Markdown wants a blank line before the first and four spaces for the
second, and without them renders the items as one paragraph. The site's copy of the page gets them.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from pymdownx.slugs import slugify

log = logging.getLogger("mkdocs.hooks.docs_site")

LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^)\s]+)\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
LIST_ITEM = re.compile(r"^(?:[-*+]|\d+\.)\s")
SHALLOW_ITEM = re.compile(r"^ {1,3}(?=(?:[-*+]|\d+\.)\s)")
SLUG = slugify(case="lower")  # as mkdocs.yml's toc, as GitHub


def anchors(markdown: str) -> set[str]:
    """The anchors of a Markdown file's headings (code fences skipped)."""
    found, fenced = set(), False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (heading := HEADING.match(line)):
            found.add(SLUG(heading.group(1).replace("`", ""), "-"))
    return found


def lists_set_apart(markdown: str) -> str:
    """A blank line before each list that starts right under a line of text, and a list inside a list
    indented by four spaces, as Python-Markdown wants (GitHub takes two or three); code fences skipped."""
    out, fenced, in_list = [], False, False
    for line in markdown.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.strip():
            item = bool(LIST_ITEM.match(line))
            if item and not in_list and out and out[-1].strip():
                out.append("")
            elif in_list and SHALLOW_ITEM.match(line):
                line = SHALLOW_ITEM.sub("    ", line)
            in_list = item or (in_list and line[0].isspace())
        out.append(line)
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return repo_links(lists_set_apart(markdown), page, config)


def repo_links(markdown: str, page, config) -> str:
    docs = os.path.abspath(config["docs_dir"])
    root = os.path.dirname(os.path.abspath(config["config_file_path"]))
    page_dir = os.path.dirname(os.path.join(docs, page.file.src_path))

    def rewrite(match: re.Match) -> str:
        text, target = match.groups()
        if SCHEME.match(target) or target.startswith("#"):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(page_dir, path))
        if resolved == docs or resolved.startswith(docs + os.sep):
            return match.group(0)  # a page of the site: MkDocs checks it
        if not resolved.startswith(root + os.sep) or not os.path.exists(resolved):
            log.warning("Doc file '%s' links to '%s', which is not a file of the repository",
                        page.file.src_path, target)
            return match.group(0)
        if anchor and resolved.endswith(".md") and anchor not in anchors(Path(resolved).read_text()):
            log.warning("Doc file '%s' links to '%s', but that file has no heading '#%s'",
                        page.file.src_path, target, anchor)
        in_repo = Path(os.path.relpath(resolved, root)).as_posix()
        if config.get("repo_url"):
            url = f"{config['repo_url'].rstrip('/')}/blob/HEAD/{in_repo}" + (f"#{anchor}" if anchor else "")
            return f"[{text}]({url})"
        return text if in_repo in text else f"{text} (`{in_repo}`)"

    return LINK.sub(rewrite, markdown)
