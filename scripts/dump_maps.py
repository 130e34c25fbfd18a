#!/usr/bin/env python
"""Generate with a CogVideoX pipeline and save its attention maps, from a checkout without installing
cogattn: the same as ``cogattn-dump`` (see ``python scripts/dump_maps.py -h``)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

if __name__ == "__main__":
    try:  # torch and diffusers take seconds to import: a Ctrl-C then is one line too
        from cogattn.dump import main
    except KeyboardInterrupt:
        print("\ndump_maps: interrupted before anything was written.", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
