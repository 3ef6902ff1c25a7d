"""Speculation policies: the pass-cost table (exact interpolation), and which rows the auto policy
lets draft as the batch fills and as a row's drafts fail."""

import json

import pytest

from mtpctl.decode import policy as policy_module
from mtpctl.decode.policy import (COSTS_FILE, AlwaysDraft, CostModelPolicy, DraftCost, PassCosts, accepted_by_size,
                                  costs_file, load_costs, load_draft_cost, make_policy)
from mtpctl.errors import BadInput

FLAT = PassCosts((1, 8, 64), (10.0, 11.0, 60.0))  # dense-like: 8 rows cost 1.1x one
STEEP = PassCosts((1, 2, 4, 8), (7.0, 8.0, 10.0, 14.0))  # int4-like: each row ~1 ms


def test_pass_costs_interpolate_and_extrapolate_linearly():
    assert FLAT(1) == 10.0 and FLAT(0) == 10.0
    assert FLAT(4.5) == pytest.approx(10.5)
    assert FLAT(36) == pytest.approx(35.5)
    assert STEEP(16) == pytest.approx(22.0)  # past the last point along the last segment


def test_pass_costs_add_what_draft_nodes_add_to_a_pass_of_requests():
    costs = PassCosts((1, 8), (7.0, 14.0), (4, 8), ((2.0, 5.0), (6.0, 9.0)))
    assert costs(1, 5) == 9.0  # one request's tree of 4 nodes
    assert costs(8) == costs(8, 8) == 14.0  # 8 one-row requests: no nodes
    assert costs(1, 3) == pytest.approx(7.0 + 1.0)  # 2 nodes: linear from no nodes at no cost
    assert costs(8, 14) == pytest.approx(14.0 + 7.5)  # 6 nodes, between the measured 4 and 8
    assert costs(4.5, 12.5) == pytest.approx(10.5 + 7.0)  # between the request counts as well
    assert costs(1, 17) == pytest.approx(7.0 + 11.0)  # past the last count along the last segment
    assert costs(2, 8) == pytest.approx(8.0 + 3.5 + 4.0 / 7)  # 6 nodes on 2 requests
    assert PassCosts((1, 8), (7.0, 21.0))(2, 8) == 21.0  # no node table: a node costs a request's row


def test_pass_costs_never_add_less_than_nothing():
    """A paired difference can come out below zero on a noisy host; nodes never make a pass cheaper."""
    costs = PassCosts((1, 8), (7.0, 14.0), (2, 4), ((-0.3, 0.5), (1.0, 2.0)))
    assert costs(1, 2) == 7.0


def test_a_lone_request_drafts_when_tree_nodes_are_cheaper_than_requests():
    rows_only = PassCosts((1, 2, 4, 8), (7.0, 9.0, 13.0, 21.0))
    with_nodes = PassCosts((1, 2, 4, 8), (7.0, 9.0, 13.0, 21.0), (4,), ((1.5,), (1.6,), (1.8,), (2.0,)))
    for costs, drafts in ((rows_only, False), (with_nodes, True)):
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


CHEAP_NODES = PassCosts((1, 8), (7.0, 14.0), (4,), ((1.0,), (4.0,)))  # 4 nodes add 1 ms to a lone pass


def test_one_failed_first_draft_does_not_stop_a_row_whose_drafts_pay():
    """Acceptance of one step is a coin toss: a row's means start from two outcomes' worth of a prior,
    so a first draft that fails leaves a lone request drafting where drafts are cheap."""
    policy = CostModelPolicy(CHEAP_NODES)
    policy.observe(0, drafted=4, accepted=0, by_size=[0, 0, 0, 0])  # prior: 1 token for the room
    assert policy.draft_sizes([4], [0]) == [4]  # (1 + 2/3) tokens in 8 ms beat 1 in 7
    assert policy._cuts[0][4] == [3, pytest.approx(2 / 3), 4.0]  # two outcomes of 1 token, one of 0


def test_a_new_row_starts_from_what_the_other_rows_drafts_got():
    policy = CostModelPolicy(CHEAP_NODES)
    for _ in range(6):
        policy.observe(0, drafted=4, accepted=2)  # pooled: 2 tokens for 4 nodes
        policy.observe(1, drafted=4, accepted=0)  # pooled: 0 tokens
    policy.observe(2, drafted=4, accepted=0)
    assert policy._whole[2] == [3, pytest.approx(2 / 3), 4.0]  # two outcomes of the pooled mean (1.0), then 0
    assert policy.draft_sizes([4], [2]) == [4]
    for row in (3, 4):
        for _ in range(3):
            policy.observe(row, drafted=4, accepted=0)
    assert policy._pooled_whole[1] == pytest.approx(12 / 19)  # a plain mean of every outcome
    assert policy.draft_sizes([4, 4], [0, 1]) == [4, 0]  # each row still judged by its own outcomes


def test_a_draft_must_also_pay_for_the_drafters_own_work():
    """4 nodes add 1 ms to a lone 7 ms pass: about 0.35 accepted tokens pay for that (1.35 / 8 beats
    1 / 7), not for 2 ms more of the drafter's own work (1.35 / 10 does not)."""
    for draft, drafts in ((DraftCost(), True), (DraftCost(call_ms=1.5, row_ms=0.5), False)):
        policy = CostModelPolicy(CHEAP_NODES, draft)
        for _ in range(20):
            policy.observe(0, drafted=4, accepted=0.3)
        assert (policy.draft_sizes([4], [0]) == [4]) is drafts


def test_the_drafters_call_is_charged_once_a_step_and_its_rows_each():
    assert DraftCost(1.5, 0.25)(0) == 0.0 and DraftCost(1.5, 0.25)(1) == 1.75 and DraftCost(1.5, 0.25)(4) == 2.5
    costs = PassCosts((1, 2), (7.0, 8.0), (4, 8), ((1.0, 2.0), (1.0, 2.0)))  # 2 requests: 4 nodes add 1 ms
    policy = CostModelPolicy(costs, DraftCost(call_ms=3.0, row_ms=0.1))
    for row in (0, 1):
        for _ in range(20):
            policy.observe(row, drafted=4, accepted=0.6)
    # the first row's draft: (2 + 0.63) / (8 + 1 + 3.1) = 0.217 < 2 / 8 = 0.25, so none drafts
    assert policy.draft_sizes([4, 4], [0, 1]) == [0, 0]
    cheap_call = CostModelPolicy(costs, DraftCost(call_ms=0.2, row_ms=0.1))
    for row in (0, 1):
        for _ in range(20):
            cheap_call.observe(row, drafted=4, accepted=0.6)
    # the first: 2.63 / 9.3 = 0.283 > 0.25; the second adds 1 ms of nodes and a row's 0.1 (the call is
    # paid): 3.26 / 10.4 = 0.313
    assert cheap_call.draft_sizes([4, 4], [0, 1]) == [4, 4]


def test_draft_costs_by_method_from_the_table(tmp_path):
    table = tmp_path / "costs.json"
    entry = {"rows": [1, 2], "ms": [7, 8], "draft_ms": {"heads": [1.5, 0.25]}}
    table.write_text(json.dumps({"version": 3, "modes": {"int4": entry}}))
    assert load_draft_cost("int4", "heads", table) == DraftCost(1.5, 0.25)
    assert load_draft_cost("int4", "ngram", table) == DraftCost()  # not measured: the pass alone is priced
    table.write_text(json.dumps({"version": 3, "modes": {"int4": dict(entry, draft_ms={"heads": [1.5, -1]})}}))
    with pytest.raises(BadInput, match="no draft costs of heads for mode int4"):
        load_draft_cost("int4", "heads", table)
    assert load_draft_cost("bfloat16", "heads+ngram", COSTS_FILE).call_ms > 0  # the AVX512-BF16 table has them


@pytest.mark.parametrize("isa, name", [("avx2", "pass_costs-avx2.json"), ("avx512-bf16", "pass_costs.json"),
                                       ("portable", "pass_costs.json"), (None, "pass_costs.json")])
def test_the_policy_reads_the_pass_costs_measured_for_this_cpus_matmul_path(monkeypatch, isa, name):
    """An AVX2-only CPU has its own table (a verify row costs half a plain step there); a path with no
    table of its own, or no native library, reads the AVX512-BF16 one."""
    monkeypatch.setattr(policy_module, "matmul_isa", lambda: isa)
    assert costs_file() == COSTS_FILE.with_name(name) and costs_file().is_file()
    assert load_costs("bfloat16") == load_costs("bfloat16", COSTS_FILE.with_name(name))


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
    entry = {"rows": [1, 2], "ms": [7, 8], "nodes": [4], "node_ms": [[2.0], [3.0]]}
    table.write_text(json.dumps({"version": 3, "modes": {"int4": entry}}))
    assert load_costs("int4", table)(1, 5) == 9.0
    table.write_text(json.dumps({"version": 3, "modes": {"int4": dict(entry, node_ms=[[2.0]])}}))
    with pytest.raises(BadInput, match="node_ms is not 2 rows of 1 times"):
        load_costs("int4", table)
    table.write_text(json.dumps({"version": 3, "modes": {"int4": dict(entry, ms=[7])}}))
    with pytest.raises(BadInput, match="2 request counts and 1 times"):
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


def test_what_each_cut_of_a_tree_would_have_kept():
    """The target kept nodes 2 and 5 of a tree (root 0): cut to its first k nodes the tree keeps those
    up to k; a stop that committed one of them caps every cut at one."""
    assert accepted_by_size([0, 2, 5], 2, 6) == [0, 1, 1, 1, 2, 2]
    assert accepted_by_size([0, 2, 5], 1, 6) == [0, 1, 1, 1, 1, 1]
    assert accepted_by_size([0], 0, 3) == [0, 0, 0]


# int4-like: a lone request's fifth row (4 draft nodes) costs far more than its fourth
INT4_LIKE = PassCosts((1, 8), (6.5, 13.2), (1, 2, 3, 4), ((0.3, 0.8, 1.4, 3.2), (1.9, 2.9, 4.5, 5.9)))


def test_a_lone_request_cuts_its_tree_where_a_node_costs_more_than_it_brings():
    policy = CostModelPolicy(INT4_LIKE)
    for _ in range(3):  # the fourth node adds 0.02 tokens for 1.8 ms
        policy.observe(0, drafted=4, accepted=1, by_size=[0.3, 0.45, 0.65, 0.67])
    assert policy.draft_sizes([4], [0]) == [3]  # 1.65 tokens in 7.9 ms beat 1.67 in 9.7 and 1.45 in 7.3
    plain = CostModelPolicy(INT4_LIKE)
    for _ in range(3):
        plain.observe(0, drafted=4, accepted=1)  # no cuts measured: the whole room or nothing, as before
    assert plain.draft_sizes([4], [0]) == [4]


def test_a_row_cut_short_probes_its_whole_room_now_and_then():
    policy = CostModelPolicy(INT4_LIKE, probe_every=3)
    for _ in range(3):
        policy.observe(0, drafted=4, accepted=1, by_size=[0.3, 0.45, 0.65, 0.67])
    decisions = []
    for _ in range(5):
        size = policy.draft_sizes([4], [0])[0]
        decisions.append(size)
        kept = [0.3, 0.45, 0.65, 0.67][:size]
        policy.observe(0, drafted=size, accepted=kept[-1] if kept else 0, by_size=kept)
    assert decisions[:3] == [3, 3, 3] and decisions[3] == 4  # cut 3 steps, then the whole room once


def test_a_probe_is_charged_the_rows_of_the_whole_room():
    """A row cut to 3 nodes of 8 probes its whole room: the probe is priced at the 5 nodes it adds
    (the row's measured cut at 8), so a credit that covers 2.5 nodes does not let it through."""
    costs = PassCosts((1, 8), (6.0, 12.0), (1, 8), ((1.0, 8.0), (1.0, 8.0)))  # 1 ms a node
    policy = CostModelPolicy(costs, probe_every=1, probe_share=0.0)
    policy.observe(0, drafted=8, accepted=2, by_size=[1.0, 1.5, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    policy.observe(0, drafted=3, accepted=2, by_size=[1.0, 1.5, 2.0])  # a cut step says nothing of the room
    assert policy.draft_sizes([8], [0]) == [3]  # 3 tokens in 9 ms
    policy._probe_credit = 2.5  # ms: half a probe of 5 nodes
    assert policy.draft_sizes([8], [0]) == [3]
    policy._probe_credit = 5.0
    assert policy.draft_sizes([8], [0]) == [8]


def test_more_draft_nodes_never_cost_less_than_fewer():
    """A noisy median can dip (4 nodes measured cheaper than 2); the policy reads the running maximum."""
    costs = PassCosts((1, 8), (6.0, 12.0), (2, 4, 8), ((3.0, 2.0, 5.0), (3.0, 2.0, 5.0)))
    assert costs(1, 5) == costs(1, 3) == 9.0
    assert costs(1, 7) == pytest.approx(6.0 + 4.0)


def test_a_node_priced_far_below_its_neighbours_across_request_counts_is_read_as_noise():
    """A node measured at +1.0 ms beside 2 requests, against +2.1 beside 1 and +2.3 beside 4 (a low
    median of the int4 table): read through a running median of three it costs +2.1 there; the first
    and last request counts, and columns without such a dip, read as measured."""
    dip = PassCosts((1, 2, 4), (7.7, 9.8, 12.6), (1,), ((2.1,), (1.0,), (2.3,)))
    assert dip(2, 3) == pytest.approx(9.8 + 2.1)
    assert dip(1, 2) == pytest.approx(7.7 + 2.1) and dip(4, 5) == pytest.approx(12.6 + 2.3)
    smooth = PassCosts((1, 2, 4), (7.7, 9.8, 12.6), (1,), ((2.1,), (2.2,), (2.3,)))
    assert smooth(2, 3) == pytest.approx(9.8 + 2.2)


@pytest.mark.parametrize("entry, message", [
    ({"rows": [1, 1], "ms": [7, 8]}, "request counts \\[1, 1\\] do not rise"),
    ({"rows": [0, 2], "ms": [7, 8]}, "do not rise from 1 or more"),
    ({"rows": [1, 2], "ms": [7, float("nan")]}, "not a finite number"),
    ({"rows": [1, 2], "ms": [7, 8], "nodes": [4, 2], "node_ms": [[1, 2], [1, 2]]}, "node counts \\[4, 2\\]"),
    ({"rows": [1, 2], "ms": [7, 8], "nodes": [2], "node_ms": [[1], [float("inf")]]}, "not a finite number"),
])
def test_a_table_the_policy_cannot_read_is_refused(tmp_path, entry, message):
    table = tmp_path / "costs.json"
    table.write_text(json.dumps({"version": 3, "modes": {"int4": entry}}))
    with pytest.raises(BadInput, match=message):
        load_costs("int4", table)
