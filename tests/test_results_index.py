"""benchmarks/results/: one folder per run, named <date>_<commit>_<kind>, each with a README;
the index README.md is what ``python -m benchmarks results-index`` generates from them."""

import os

from benchmarks import results_index


def test_every_run_is_a_named_folder_with_a_readme():
    names = results_index.runs()
    assert names
    for name in names:
        assert results_index.RUN_NAME.match(name), name
        assert results_index.title_of(os.path.join(results_index.RESULTS, name)), name
    loose = [
        name
        for name in os.listdir(results_index.RESULTS)
        if not os.path.isdir(os.path.join(results_index.RESULTS, name))
    ]
    assert loose == ["README.md"]


def test_the_index_is_generated_from_the_runs():
    with open(os.path.join(results_index.RESULTS, "README.md")) as f:
        assert f.read() == results_index.render(), "run python -m benchmarks results-index"
