"""The stateful protocol test's pieces (tests/test_stateful_protocol.py): the world (ledger, two destinations, faults,
the code a worker runs, an independent reader), the parties that drive the protocol one step at a time, the state
machine, and the guards its mutation tests remove."""

import os
import tempfile

from hypothesis.configuration import set_hypothesis_home_dir

# Hypothesis keeps a cache (and, unless told otherwise, an example database) under ./.hypothesis: keep the checkout
# clean. The machines run with database=None; this is where the rest goes.
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "export-ledger-hypothesis"))
