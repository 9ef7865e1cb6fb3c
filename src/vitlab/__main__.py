"""``python -m vitlab`` runs the command line."""

import sys

from vitlab.cli import main

if __name__ == "__main__":
    sys.exit(main())
