"""`python -m ebpo ...` is the `ebpo` command (useful where pip's script folder is not on PATH)."""
from ebpo.cli import main

raise SystemExit(main())
