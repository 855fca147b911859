"""`python -m server`: see `python -m server --help`."""

import sys

from server.launch import main

if __name__ == "__main__":
    sys.exit(main())
