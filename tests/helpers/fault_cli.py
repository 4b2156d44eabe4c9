"""`python -m tests.helpers.fault_cli <normlab arguments>`: the real `normlab` command line, with the test faults
named by NORMLAB_TEST_FAULTS installed first (tests/helpers/faults.py). Lightning starts the other ranks by
re-running this same module, so every rank has them."""
import os
import sys

from tests.helpers.faults import FAULTS_ENV, installed
from training.cli import main

if __name__ == "__main__":
    with installed(os.environ.get(FAULTS_ENV, "")):
        code = main()
    sys.exit(code)
