"""`benchmarks.controller`'s "chosen" method: the settings `choose_settings` picks at the
controller's threshold, kept for a whole training run."""

from __future__ import annotations

import re

from benchmarks.controller import train


def test_chosen_settings_train_and_name_what_was_chosen():
    record = train("w3", "chosen", epochs=1, ranks=2)
    # 'L<levels> m<m> <relax> <forward>/<backward>[ nested ...]', at most the case's cycles
    match = re.fullmatch(r"L(\d+) m(\d+) [F/C]+ (\d+)/(\d+)( nested.*)?", record["chosen"])
    assert match, record["chosen"]
    assert int(match[3]) <= 2 and int(match[4]) <= 1
    # one epoch of the digits trains far past chance (10 classes)
    assert record["test_accuracy"] > 0.8
    assert record["cpu_seconds"] > 0
