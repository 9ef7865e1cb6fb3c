"""``python -m vitlab`` runs the command line."""

import sys

from vitlab.cli import main

sys.exit(main())
