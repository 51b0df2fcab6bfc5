"""`radixserve serve ...` with every step's StepInfo written as a JSON line to $STEPLOG (the engine's own
step observer, core.StepInfo): how the server-side steps of a workload were made up.

    STEPLOG=steps.jsonl python serve_with_step_log.py serve --host 127.0.0.1 --port 8013 --no-web --speculation on
"""

import dataclasses
import json
import os
import sys

from radixserve.cli import main
from radixserve.engine.engine import LLMEngine

log = open(os.environ["STEPLOG"], "w")  # noqa: SIM115 (open for the server's whole life)
plain_init = LLMEngine.__init__


def init_with_step_log(self, *args, **kwargs):
    plain_init(self, *args, **kwargs)
    self.add_step_observer(lambda info: (log.write(json.dumps(dataclasses.asdict(info)) + "\n"), log.flush()))


LLMEngine.__init__ = init_with_step_log
sys.exit(main(sys.argv[1:]))
