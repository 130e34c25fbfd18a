"""MkDocs hooks: the site's home page is the README, its links to ``docs/`` made relative to the site."""

from pathlib import Path


def on_page_markdown(markdown, page, config, files):
    """The README's text for ``index.md``, so the front door is written once."""
    if page.file.src_uri != "index.md":
        return markdown
    readme = Path(config.config_file_path).parent / "README.md"
    return readme.read_text().replace("](docs/", "](")
