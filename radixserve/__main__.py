"""`python -m radixserve` runs the `radixserve` command (for machines where the package is on the
path but not installed, such as a GPU box that runs scripts/gpu_check.sh from a checkout)."""

import sys

from radixserve.cli import main

sys.exit(main())
