"""``python tools/convert_hf.py export CHECKPOINT OUT_DIR``, as before the tools shipped in the
wheel: the same program as the console script ``parallel3d-convert-hf`` (parallel3d/cli/convert_hf.py)."""

import sys

from parallel3d.cli.convert_hf import main

if __name__ == "__main__":
    sys.exit(main())
