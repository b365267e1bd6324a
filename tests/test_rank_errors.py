"""Errors from many ranks stay readable: one line per distinct message."""

from hpctrain.errors import RankErrors, rank_ranges

REFUSALS = {
    0: "the model will not fit: about 1,417 MiB (340 MiB resident)",
    1: "the model will not fit: about 1,413 MiB (336 MiB resident)",
    2: "the model will not fit: about 1,417 MiB (340 MiB resident)",
    3: "dataset file not found: /data/x.h5",
}


def test_identical_messages_are_one_line_naming_the_ranks():
    said = RankErrors({r: "dataset file not found: /data/x.h5" for r in range(512)})
    assert str(said) == "rank(s) 0-511: dataset file not found: /data/x.h5"
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_one_models_refusals_differing_in_figures_only_are_one_line():
    """The data-parallel memory refusal counts each rank's own baseline: N ranks gave
    N lines. Merged where asked (one model on every rank), not by default: pipeline
    stages' messages differ in their numbers and each one matters."""
    assert str(RankErrors(REFUSALS, merge_figures=True)).splitlines()[1:] == [
        "  rank(s) 0-2: the model will not fit: about 1,417 MiB (340 MiB resident) "
        "(rank(s) 1: the same with other figures)",
        "  rank(s) 3: dataset file not found: /data/x.h5",
    ]
    assert len(str(RankErrors(REFUSALS)).splitlines()) == 4  # a blank first line, then 3


def test_a_one_rank_job_says_its_error_without_naming_rank_zero():
    assert str(RankErrors({0: "dataset file not found: /x.h5"}, alone=True)) == (
        "dataset file not found: /x.h5"
    )
