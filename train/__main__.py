"""`python -m pallasite.train ...` runs `pallasite train ...`."""

import sys

from .cli import main

sys.exit(main())
