"""MkDocs hooks (mkdocs.yml `hooks:`): the docs build fails when a generated reference page is stale or when the
API reference renders a public name without a docstring, so `mkdocs build --strict` in CI checks both."""
from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[1]


def on_pre_build(config, **kwargs) -> None:
    """Run scripts/gen_docs_reference.py --check and scripts/check_api_docs.py before the pages are read."""
    for path in (str(ROOT), str(ROOT / "scripts")):
        if path not in sys.path:
            sys.path.insert(0, path)
    import check_api_docs
    import gen_docs_reference

    stale = gen_docs_reference.stale()
    if stale:
        raise PluginError(f"stale generated reference pages {stale}: run `python scripts/gen_docs_reference.py`")
    if check_api_docs.main() != 0:
        raise PluginError("the API reference renders undocumented public names (listed above): add docstrings")
