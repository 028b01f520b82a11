"""Command-line entry: python -m kvrelay."""

import sys

from kvrelay.cli import main

sys.exit(main())
