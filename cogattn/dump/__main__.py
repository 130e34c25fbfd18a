"""``python -m cogattn.dump``: the same as the console script ``cogattn-dump``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
