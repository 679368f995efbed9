"""mkdocs hook: the API reference, rendered by pdoc from the docstrings, as the site's ``api/``.

The same pages as the README's ``python -m pdoc -d google strategy ... -o docs/api`` command (the
modules are ``extra.api_modules`` in mkdocs.yml). A pdoc warning is logged as a build warning, so
``mkdocs build --strict`` fails on it as on a broken link.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

from mkdocs.plugins import get_plugin_logger
from mkdocs.structure.files import File, Files, InclusionLevel
from mkdocs.structure.nav import Link, Navigation

log = get_plugin_logger("pdoc")


def on_files(files: Files, config) -> Files:
    import pdoc
    import pdoc.render

    for stale in [f for f in files if f.src_uri.startswith("api/")]:  # a local docs/api build
        files.remove(stale)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.render.configure(docformat="google")
        pdoc.pdoc(*config.extra["api_modules"], output_directory=Path(tmp))
        for w in caught:
            if "pdoc" in Path(w.filename).parts:  # pdoc's own, not the imported libraries'
                log.warning("%s: %s", w.category.__name__, w.message)
        for path in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
            uri = "api/" + path.relative_to(tmp).as_posix()
            files.append(File.generated(config, uri, content=path.read_bytes(),
                                        inclusion=InclusionLevel.INCLUDED))
    return files


def on_nav(nav: Navigation, config, files: Files) -> Navigation:
    nav.items.append(Link("API reference", "api/index.html"))  # after mkdocs checked nav links
    return nav
