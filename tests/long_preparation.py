"""Launched by ``test_multiprocess_data.py`` on two processes: the default process group gives up
after 10 s, the main process prepares data for 15 s while the other waits; prints what each read.
(The group's set-up takes the same timeout: both processes must reach it within 10 s of each other,
which a shorter one missed on a loaded 2-core machine running two test workers.)"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from pathlib import Path

from accelerate import PartialState

from draftsmith.recipe import Recipe
from draftsmith.train.distributed import main_process_first

state = PartialState(backend="gloo", timeout=timedelta(seconds=10))  # main_process_first takes it over
marker = Path(sys.argv[1])
with main_process_first(Recipe()):
    if state.is_main_process:
        time.sleep(15)
        marker.write_text("prepared")
    print(f"RESULT {state.process_index} {marker.read_text()}", flush=True)
