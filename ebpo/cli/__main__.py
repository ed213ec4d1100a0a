"""`python -m ebpo.cli ...` (what `deepspeed --module ebpo.cli` launches on every rank)."""
from ebpo.cli import main

raise SystemExit(main())
