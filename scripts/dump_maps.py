#!/usr/bin/env python
"""Generate with a CogVideoX pipeline and save its attention maps, from a checkout without installing
cogattn: the same as ``cogattn-dump`` (see ``python scripts/dump_maps.py -h``)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cogattn.dump import main

if __name__ == "__main__":
    sys.exit(main())
