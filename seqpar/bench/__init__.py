"""``seqpar bench``: time every method against the ideal, on N ranks or emulated on one device.

Modules: :mod:`.core` (cases, FLOP formulas, the per-rank runner), :mod:`.suite` (flags and suite
files -> validated matrix of cases), :mod:`.report` (rich table, CSV/JSON with machine, versions
and command), :mod:`.plots` (PNGs), :mod:`.emulate` (``--emulate N``: every rank's per-step kernels
back to back on one device), :mod:`.memory` (peak memory per rank), :mod:`.cli` (the command).

The replay of per-rank traces (docs/tracing.md): :mod:`.schedule_trace` (traces built from the
schedules), :mod:`.trace_check` (consistency), :mod:`.replay` (the discrete-event replay),
:mod:`.machine` (links and kernel models, with sources), :mod:`.trace_export` (Perfetto JSON, PNG),
:mod:`.simulate` / :mod:`.simulate_cli` (``seqpar simulate``), :mod:`.replay_validate` (against runs
on this machine), :mod:`.replay_coeffs` (the cost model's coefficients).
"""

from .core import (
    BenchCase,
    BenchRow,
    attention_flops,
    case_flops,
    linear_flops,
    run_case_on_rank,
    run_cases,
    stdlib_doc_lengths,
)
from .report import environment, print_linear_table, print_table, write_csv, write_json
from .suite import expand_matrix, load_suite, run_linear_cases, validate_case

__all__ = [
    "BenchCase", "BenchRow", "attention_flops", "case_flops", "environment", "expand_matrix", "linear_flops",
    "load_suite", "print_linear_table", "print_table", "run_case_on_rank", "run_cases", "run_linear_cases",
    "stdlib_doc_lengths", "validate_case", "write_csv", "write_json",
]
