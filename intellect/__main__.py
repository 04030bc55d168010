"""`python -m intellect ...` runs the `intellect` command line."""

import sys

from intellect.cli import main

sys.exit(main())
