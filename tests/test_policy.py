"""Speculation policies: the pass-cost table (exact interpolation), and which rows the auto policy
lets draft as the batch fills and as a row's drafts fail."""

import json

import pytest

from mtpctl.decode.policy import AlwaysDraft, CostModelPolicy, PassCosts, load_costs, make_policy
from mtpctl.errors import BadInput

FLAT = PassCosts((1, 8, 64), (10.0, 11.0, 60.0))  # dense-like: 8 rows cost 1.1x one
STEEP = PassCosts((1, 2, 4, 8), (7.0, 8.0, 10.0, 14.0))  # int4-like: each row ~1 ms


def test_pass_costs_interpolate_and_extrapolate_linearly():
    assert FLAT(1) == 10.0 and FLAT(0) == 10.0
    assert FLAT(4.5) == pytest.approx(10.5)
    assert FLAT(36) == pytest.approx(35.5)
    assert STEEP(16) == pytest.approx(22.0)  # past the last point along the last segment


def test_pass_costs_split_into_sequences_and_rows():
    costs = PassCosts((1, 2, 4, 8), (7.0, 9.0, 13.0, 21.0), (7.0, 7.5, 8.5, 12.0))  # a sequence ~1 ms more than a node
    assert costs(1, 8) == 12.0  # one request's tree of 8 nodes
    assert costs(8) == costs(8, 8) == 21.0  # 8 one-row requests
    assert costs(2, 8) == pytest.approx(9.0 + 12.0 - 7.5)  # two requests, 6 draft nodes between them
    assert PassCosts((1, 8), (7.0, 21.0))(2, 8) == 21.0  # no tree table: a node costs a request's row


def test_a_lone_request_drafts_when_tree_nodes_are_cheaper_than_requests():
    rows_only = PassCosts((1, 2, 4, 8), (7.0, 9.0, 13.0, 21.0))
    with_tree = PassCosts((1, 2, 4, 8), (7.0, 9.0, 13.0, 21.0), (7.0, 7.5, 8.5, 12.0))
    for costs, drafts in ((rows_only, False), (with_tree, True)):
        policy = CostModelPolicy(costs)
        for _ in range(4):
            policy.observe(0, drafted=4, accepted=1)  # 2 tokens for 5 rows
        assert (policy.draft_sizes([4], [0]) == [4]) is drafts


def test_a_lone_request_drafts_when_its_drafts_are_worth_their_rows():
    policy = CostModelPolicy(FLAT)
    assert policy.draft_sizes([6], [0]) == [6]
    for _ in range(3):
        policy.observe(0, drafted=6, accepted=1)  # 1 token for 6 rows: worth it where rows are cheap
    assert policy.draft_sizes([6], [0]) == [6]


def test_a_full_batch_of_costly_rows_drafts_less():
    policy = CostModelPolicy(STEEP)
    rows = list(range(8))
    for row in rows:
        for _ in range(4):
            policy.observe(row, drafted=4, accepted=1)
    sizes = policy.draft_sizes([4] * 8, rows)
    assert sizes == [0] * 8  # 8 tokens in 14 ms beat 8 + 1 tokens in 18 ms
    assert CostModelPolicy(STEEP).draft_sizes([4], [0]) == [4]  # alone, the same drafts pay


def test_a_row_whose_drafts_keep_failing_stops_then_probes():
    policy = CostModelPolicy(STEEP, probe_every=8)
    for _ in range(10):
        policy.observe(0, drafted=4, accepted=0)
    decisions = []
    for _ in range(9):
        size = policy.draft_sizes([4], [0])[0]
        decisions.append(size)
        policy.observe(0, drafted=size, accepted=0)
    assert decisions[:8] == [0] * 8 and decisions[8] == 4  # left out 8 steps, then drafts once to re-measure


def test_an_unmeasured_row_drafts_once_to_measure_itself():
    policy = CostModelPolicy(STEEP)
    assert policy.draft_sizes([8], [0]) == [8]  # the prior (1 token for 8 rows) would not pay: a probe
    policy.observe(0, drafted=8, accepted=6)  # the first outcome is the estimate, not a tenth of it
    assert policy.draft_sizes([8], [0]) == [8]


def test_probes_in_a_full_batch_stay_within_their_share_of_the_time():
    policy = CostModelPolicy(STEEP, probe_share=0.03)
    rows = list(range(8))
    for row in rows:
        policy.observe(row, drafted=4, accepted=0)
    plain_ms, probe_ms = 0.0, 0.0
    for _ in range(400):
        sizes = policy.draft_sizes([4] * 8, rows)
        nodes = sum(sizes)
        plain_ms += STEEP(8)
        probe_ms += STEEP(8 + nodes) - STEEP(8)
        for row, size in zip(rows, sizes):
            policy.observe(row, drafted=size, accepted=0)
    assert 0 < probe_ms <= 0.03 * plain_ms + STEEP(8)  # probes happen, at most 3% of the time


def test_always_drafts_the_room():
    assert AlwaysDraft().draft_sizes([3, 0, 5], [0, 1, 2]) == [3, 0, 5]


def test_policies_by_name(tmp_path):
    assert isinstance(make_policy("always", "int4"), AlwaysDraft)
    assert isinstance(make_policy("auto", None), AlwaysDraft)  # one pass per request: every row as alone
    assert isinstance(make_policy("auto", "bfloat16"), CostModelPolicy)  # the shipped table has every mode
    with pytest.raises(BadInput, match="choose auto or always"):
        make_policy("sometimes", "int4")
    table = tmp_path / "costs.json"
    table.write_text(json.dumps({"version": 1, "modes": {"int4": {"rows": [1, 2], "ms": [7, 8]}}}))
    assert load_costs("int4", table)(2) == 8.0
    table.write_text(json.dumps({"version": 2, "modes": {"int4": {"rows": [1, 2], "ms": [7, 8], "tree_ms": [7, 7.5]}}}))
    assert load_costs("int4", table)(1, 2) == 7.5
    table.write_text(json.dumps({"version": 2, "modes": {"int4": {"rows": [1, 2], "ms": [7, 8], "tree_ms": [7]}}}))
    with pytest.raises(BadInput, match="2 row counts, 2 times and 1 tree times"):
        load_costs("int4", table)
    with pytest.raises(BadInput, match="no pass costs for mode float32"):
        load_costs("float32", table)


def test_a_step_whose_drafter_found_nothing_does_not_count_as_a_failed_draft():
    """Prompt lookup often finds no match early on: such a step spent no rows and says nothing about
    the drafter's drafts, so the row keeps drafting when its drafts pay."""
    policy = CostModelPolicy(STEEP)
    assert policy.draft_sizes([3], [0]) == [3]
    policy.observe(0, drafted=0, accepted=0)  # allowed 3, proposed none
    assert policy.draft_sizes([3], [0]) == [3]  # still unmeasured: it may draft
    policy.observe(0, drafted=3, accepted=3)
    policy.observe(0, drafted=0, accepted=0)
    assert policy.draft_sizes([3], [0]) == [3]  # 4 tokens for 4 rows pay; the empty step changed nothing
