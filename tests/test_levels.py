"""The level-by-level split of a training step's critical path (benchmarks.studies.levels):
every compute span and every hop of the path is charged somewhere, and the solves' spans
go to the levels they belong to."""

import pytest

from benchmarks.studies import levels


@pytest.mark.parametrize("hot", [False, True])
def test_the_split_accounts_for_the_whole_path_by_pass_and_level(hot):
    """Of virtual ranks and of warm ones (each run again alone)."""
    result = levels.measure(levels.NAMES[0], ranks=4, repeats=1, warmup=1, hot=hot)
    assert result["warm"] is hot
    critical = result["critical"]
    assert sum(result["compute"].values()) == pytest.approx(critical["compute"], rel=1e-9)
    assert sum(result["hops"].values()) == critical["hops"]
    # W2's four levels, in both solves; the rest of the step outside them
    passes = {name.split("/")[0] for name in result["compute"]}
    assert passes <= {"step", "forward", "adjoint"} and {"forward", "adjoint"} <= passes
    solved = {name for name in result["compute"] if not name.endswith("/-")}
    assert {name.split("/")[1] for name in solved} <= {"0", "1", "2", "3"}
    assert "forward/0" in solved and "adjoint/0" in solved
    assert "| pass/level |" in levels.table([result])


def test_variants_are_named_by_number_and_a_bad_one_is_refused():
    assert "(default)" in levels.NAMES[0]
    for bad in ("9", "one", "0,"):
        with pytest.raises(SystemExit):
            levels.main(["--variants", bad])
