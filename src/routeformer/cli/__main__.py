"""`python -m routeformer.cli ...` (and `torchrun ... -m routeformer.cli ...`): the `routeformer` command."""

import sys

from routeformer.cli import main

if __name__ == "__main__":  # importing this module (a tool that scans the package) runs nothing
    sys.exit(main())
