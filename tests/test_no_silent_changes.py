"""Nothing is shrunk, clipped, dropped or read as something else silently: an input that cannot be
honoured is a ValueError naming it (and, for lengths, the longest that would fit).

Found by an audit of the readers of lengths, calibration files, suites and options (each test
below failed before its fix):

- ``seqpar plan --dist stdlib-mix --world-size 64 --methods ulysses`` planned "512 sequences, 512
  tokens": ``max_fitting_length`` looked at the largest group only (64 ranks, more than Ulysses'
  32 heads), found nothing, and ``fit_to_cluster`` cut every length to 1; it also cut any length
  above 90% of the fit without a word;
- suites: ``"packed": "false"`` read as true (``bool("false")``), ``"seed": 3.7`` as 3, a length
  listed twice (``[2048, "2k"]``) dropped, ``emulate`` silently replacing ``world_sizes`` and
  ``dtypes`` replacing ``dtype``;
- ``seqpar train``: ``--grad-clip -1`` read as "off", ``--warmup -1`` as no warmup with the cosine
  past its end; an unreadable data file skipped;
- cost-model and calibration files: an unknown (misspelt) key ignored, a newer version read as 1;
- ``seqpar simulate --heads 0`` (and --kv-heads, --head-dim, --layers) read as "the default".
"""

from __future__ import annotations

import json
import os

import pytest

from seqpar.bench.simulate_cli import main as simulate_main
from seqpar.bench.suite import expand_matrix
from seqpar.schedulers import ClusterSpec, CostModel, fit_to_cluster, sample_lengths
from seqpar.schedulers.calibration import load_calibration, save_calibration
from seqpar.schedulers.cli import plan_main
from seqpar.schedulers.data import max_fitting_length

CM = CostModel.default()
WORLD64 = ClusterSpec.h100(world_size=64)


def test_every_group_size_counts_for_the_longest_fitting_length():
    """Ulysses cannot run on the 64-rank group (32 heads) but fits millions of tokens on 32 ranks."""
    assert max_fitting_length(WORLD64, CM, ["ulysses"]) > 1_000_000
    lens = fit_to_cluster(sample_lengths(512, 0, "stdlib-mix"), WORLD64, CM, 32768, ["ulysses"])
    assert abs(int(lens.sum()) - 32768 * 64) < 512 and lens.max() > 10_000  # scaled, not cut to 1


def test_a_length_that_does_not_fit_raises_naming_the_longest_that_would():
    fit = max_fitting_length(WORLD64, CM, ["ulysses"])
    with pytest.raises(ValueError, match=f"1 of 2 sequences are longer than {fit:,} tokens"):
        fit_to_cluster([fit + 1, 10], WORLD64, CM, methods=["ulysses"])
    assert list(fit_to_cluster([fit, 10], WORLD64, CM, methods=["ulysses"])) == [fit, 10]  # the limit fits
    tiny = ClusterSpec(world_size=8, memory_per_rank=1e6)
    with pytest.raises(ValueError, match="can hold even one token with ulysses"):
        fit_to_cluster([10], tiny, CM, methods=["ulysses"])


def test_seqpar_plan_says_what_fits(capsys):
    args = ["--dist", "stdlib-mix", "--world-size", "64", "--methods", "ulysses", "--tokens-per-rank", "3500000"]
    assert plan_main(args) == 2
    err = capsys.readouterr().err
    assert "are longer than 5,059,523 tokens, the longest that fits" in err and "ulysses" in err


@pytest.mark.parametrize("config,match", [
    ({"packed": "false", "methods": "ring"}, None),
    ({"packed": "maybe"}, "packed: expected true or false"),
    ({"seed": 3.7}, "seed: expected integers"),
    ({"repeats": [3, 4]}, "repeats: expected one integer"),
    ({"seq_lens": [2048, "2k"]}, "seq_lens: '2k' is listed twice"),
    ({"causal": [True, True]}, "lists a value twice"),
    ({"world_sizes": [2], "emulate": 4}, "not both"),
    ({"dtypes": ["float32"], "dtype": "bfloat16"}, "not both"),
    ({"dtypes": ["float32", "float32"]}, "listed twice"),
])
def test_suite_values_are_read_as_written(config, match):
    if match is None:
        assert all(c.packed_seed is None for c in expand_matrix(config))  # "false" is false
        return
    with pytest.raises(ValueError, match=match):
        expand_matrix(config)


@pytest.mark.parametrize("flag,value", [("--grad-clip", "-1"), ("--warmup", "-1"), ("--weight-decay", "-0.1"),
                                        ("--timeout", "0"), ("--lr", "inf"), ("--weight-decay", "inf")])
def test_trainer_flags_are_not_reinterpreted(flag, value):
    from seqpar.integrations.train.config import parse_args, validate

    with pytest.raises(ValueError, match=f"{flag}: expected a"):
        validate(parse_args([flag, value]), 1)


def test_an_unreadable_data_file_is_an_error(tmp_path):
    from seqpar.integrations.train.data import TextFiles

    (tmp_path / "a.txt").write_text("hello")
    os.symlink(tmp_path / "missing.txt", tmp_path / "b.txt")
    with pytest.raises(ValueError, match="cannot read .*b.txt"):
        TextFiles.scan(str(tmp_path))


def test_model_files_with_unknown_keys_or_versions_are_refused(tmp_path):
    data = CM.to_dict()
    for bad, match in (({"modle": {}}, r"unknown key\(s\) \['modle'\]"), ({"version": 2}, "version 2")):
        path = tmp_path / "cm.json"
        path.write_text(json.dumps({**data, **bad}))
        with pytest.raises(ValueError, match=match):
            CostModel.load(str(path))
    cal = tmp_path / "cal.json"
    save_calibration(cal, WORLD64, CM, command="test")
    load_calibration(cal)  # what seqpar calibrate writes reads back
    cal.write_text(json.dumps({**json.loads(cal.read_text()), "clusterr": {}}))
    with pytest.raises(ValueError, match="unknown key"):
        load_calibration(cal)


@pytest.mark.parametrize("argv,match", [(["--heads", "0"], "--heads: expected a positive integer"),
                                        (["--kv-heads", "0"], "--kv-heads: expected a positive"),
                                        (["--seq-len", "1k,2k"], "--seq-len: one length")])
def test_simulate_reads_zero_as_zero(argv, match, capsys):
    assert simulate_main(argv) == 2
    assert match in capsys.readouterr().err
