"""MkDocs hook (mkdocs.yml): a page's links to the repository's files outside docs/.

The pages link to files such as ``../deploy/README.md`` so that they work where the Markdown is
read in the repository. The site holds only docs/, so MkDocs would report such a link as not found;
this hook checks that the file exists (a link to a missing file is a warning, which fails the strict
build like any other broken link) and writes the link as the file's path in the repository, or as a
link to it under ``repo_url`` when mkdocs.yml names one.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.docs_links")

LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^)\s]+)\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    page_dir = (docs / page.file.src_path).parent

    def rewrite(match: re.Match) -> str:
        text, target = match.groups()
        if SCHEME.match(target) or target.startswith("#"):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = (page_dir / path).resolve()
        if resolved == docs or docs in resolved.parents:
            return match.group(0)  # a page of the site: MkDocs checks it
        if root not in resolved.parents or not resolved.exists():
            log.warning("Doc file '%s' links to '%s', which is not a file of the repository", page.file.src_path,
                        target)
            return match.group(0)
        in_repo = resolved.relative_to(root).as_posix()
        if config.get("repo_url"):
            url = f"{config['repo_url'].rstrip('/')}/blob/HEAD/{in_repo}" + (f"#{anchor}" if anchor else "")
            return f"[{text}]({url})"
        return text if in_repo in text else f"{text} (`{in_repo}`)"

    return LINK.sub(rewrite, markdown)
