"""`python -m ragkv` runs the CLI."""

import sys

from ragkv.cli import main

sys.exit(main())
