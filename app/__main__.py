"""`python -m app` is the same program as `glassbox`."""

import sys

from app.cli import main

sys.exit(main())
